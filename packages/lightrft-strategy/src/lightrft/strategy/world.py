"""`World`: what a strategy's components know of the run they serve.

A backend, the engine link and the checkpoint code are given a ``World`` instead of the
strategy: the config, the ranks and device once the process group is joined, the
accumulation, each model's step counters and the collectives they may call. The
strategy builds one before its setup and fills it in when it joins the group
(:meth:`World.join`); nothing in it refers back to the strategy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.strategy import collectives, distributed, roll_call
from lightrft.strategy.actor import unwrap_model
from lightrft.strategy.construction import NotSetUpError
from lightrft.strategy.stepping import StepState, StepStates

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.strategy.micro_batches import StepPlan

__all__ = ["World"]


class World:
    """The run as components see it. Before :meth:`join`: a world of one on the CPU.

    Attributes:
        config: the strategy's configuration.
        sizes: the config whose parallel sizes (``sp_size``, ``engine_tp_size``) this
            process runs with: ``config``, except where a backend simulates them (the
            fake strategy plays every group alone).
        launch: the launcher's view of this process (rank, local rank, sizes).
        device: the device models train on.
        accumulated_gradient: micro-batches per optimizer step (the config's).
        plan: the step planned by ``plan_micro_batches`` while it runs; its number of
            micro-batches is then the accumulation (:attr:`accumulation`).
        step_states: each model's step counters, keyed by the unwrapped module.
        ready, closed: whether the strategy is set up, and whether it was closed since.
        alone: world size 1 and rank 0 whatever the environment or a process group
            says (the fake strategy, one process playing every rank); it creates no
            process group, so its collectives reduce over itself.
        owner: the name of the strategy's class, for errors.
    """

    def __init__(self, config: StrategyConfig, owner: str = "strategy") -> None:
        self.config = config
        self.sizes = config
        self.launch = distributed.LaunchEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
        self.device = torch.device("cpu")
        self.accumulated_gradient = 1
        self.plan: StepPlan | None = None
        self.ready = False
        self.closed = False
        self.alone = False
        self.owner = owner
        self.step_states = StepStates()

    def join(
        self, launch: distributed.LaunchEnv, device: torch.device, job_size: int | None = None
    ) -> None:
        """The process group is joined (or this is a world of one): its ranks and device,
        and the accumulation they give. ``job_size``: the job's ranks when they are more
        than the group's (engine ranks of their own: the config counts them out)."""
        self.launch, self.device = launch, device
        size = 1 if self.alone else dist.get_world_size() if dist.is_initialized() else None
        if job_size is not None and not self.alone:
            size = job_size
        self.accumulated_gradient = self.sizes.gradient_accumulation_steps(
            launch.world_size if size is None else size
        )

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step now: the planned step's micro-batches while a
        plan runs, else ``accumulated_gradient``."""
        plan = self.plan
        return plan.num_micro_batches if plan is not None else self.accumulated_gradient

    def closes_accumulation(self, state: StepState) -> bool:
        """Whether the next micro-step of the model counted by ``state`` is the last of
        its accumulation (its gradients are then reduced and the optimizer steps)."""
        return state.accumulated + 1 >= self.accumulation

    @property
    def world_size(self) -> int:
        """Ranks in the job: the process group's size once joined; before that, what the
        launcher put in the environment (never a silent 1 inside a launched job)."""
        if self.alone:
            return 1
        if dist.is_initialized():
            return dist.get_world_size()
        if self.ready:
            return self.launch.world_size
        return distributed.LaunchEnv.from_environ().world_size

    def get_rank(self) -> int:
        if self.alone:
            return 0
        return dist.get_rank() if dist.is_initialized() else self.launch.rank

    def is_rank_0(self) -> bool:
        return self.get_rank() == 0

    def require_setup(self, what: str) -> None:
        """Raise :class:`NotSetUpError` naming ``what`` when setup has not run."""
        if self.ready:
            return
        launch = distributed.LaunchEnv.from_environ()
        where = (
            f"this process is rank {launch.rank} of a job of WORLD_SIZE={launch.world_size} "
            f"({launch.launcher}), so it would train alone"
            if launch.world_size > 1
            else "the process group, device, seed and accumulation are not set"
        )
        if self.closed:
            raise NotSetUpError(
                f"{what}: this {self.owner} was closed; {where}. Build a new "
                "strategy, or call strategy.setup_distributed() again"
            )
        raise NotSetUpError(
            f"{what}: {self.owner} was built with defer_setup=True and "
            f"strategy.setup_distributed() has not run; {where}. Call "
            "strategy.setup_distributed() first, or build the strategy without defer_setup"
        )

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for in a world of one)."""
        if not self.alone and dist.is_initialized() and dist.get_world_size() > 1:
            with roll_call.guard("barrier"):
                dist.barrier()

    def all_reduce(self, data: Any, op: collectives.ReduceOp = "mean") -> Any:
        """:func:`lightrft.strategy.collectives.all_reduce`, naming a lost rank."""
        with roll_call.guard("all_reduce"):
            return collectives.all_reduce(data, op)

    def all_gather_object(self, data: Any) -> list[Any]:
        """Every rank's picklable ``data``, in rank order (``[data]`` in a world of one)."""
        if self.alone or not dist.is_initialized() or dist.get_world_size() == 1:
            return [data]
        gathered: list[Any] = [None] * dist.get_world_size()
        with roll_call.guard("all_gather"):
            dist.all_gather_object(gathered, data)
        return gathered

    def step_state(self, model: nn.Module) -> StepState:
        """``model``'s step counters (micro/global/skipped steps, weight changes)."""
        return self.step_states[unwrap_model(model)]
