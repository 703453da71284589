# size: the training API a trainer calls, in one class: about fifty methods, each a docstring
#   and a few lines handing the work to the backend, the engine link or a module of its own
"""`StrategyBase`: the one interface training code is written against.

The class holds the lifecycle (distributed setup, seeding, readiness, close) and the
training API (prepare, backward, optimizer step, data loaders, checkpoints, models saved
for Hugging Face, the engine calls), with its components as attributes, each built from
``world`` (:class:`~lightrft.strategy.world.World`: config, ranks, device, accumulation,
step counters) and never from the strategy: ``backend`` (a
:class:`~lightrft.strategy.backend.Backend`: how models are wrapped, stepped, gathered,
saved and loaded on FSDP2 or DeepSpeed), ``engine_link`` (weight sync, generation,
sleep/wake: :mod:`lightrft.strategy.engine_link`) and ``checkpoints`` (a
:class:`~lightrft.strategy.checkpoint.manager.CheckpointManager`). Upstream's engine
calls of other shapes and its read-only attributes are delegates mixed in from
:mod:`lightrft.strategy.upstream_names`. The rest of the work lives in modules this class
calls: collectives, data, stepping, optim and sequence parallelism
(``sequence_parallel``, ``ulysses``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lightrft.config import StrategyConfig
from lightrft.strategy import (
    collective_threads,
    collectives,
    distributed,
    engine_ranks,
    lora,
    roll_call,
    sequence_parallel,
    ulysses,
)
from lightrft.strategy.actor import is_actor, training_module, unwrap_model
from lightrft.strategy.backend import Backend, Triple
from lightrft.strategy.checkpoint.manager import CheckpointManager
from lightrft.strategy.checkpoint.subject import CheckpointSubject
from lightrft.strategy.construction import (
    BASE_PARAMETERS,
    config_from_constructor,
)
from lightrft.strategy.data import ResumableDataLoader, build_dataloader
from lightrft.strategy.engine_link import DEFAULT_BUCKET_BYTES, EngineLink
from lightrft.strategy.micro_batches import PlanError, StepPlan, make_plan
from lightrft.strategy.optim import build_scheduler, parameter_groups
from lightrft.strategy.stepping import StepState
from lightrft.strategy.upstream_names import UpstreamAttributes, UpstreamEngineCalls
from lightrft.strategy.world import World

if TYPE_CHECKING:
    from lightrft.engines.protocol import GenerationOutput

logger = logging.getLogger("lightrft.strategy")
_print_logger = logging.getLogger("lightrft.strategy.print")

__all__ = ["StrategyBase", "Triple"]


class StrategyBase(UpstreamAttributes, UpstreamEngineCalls):
    """A distributed training strategy. Build one with :func:`lightrft.strategy.get_strategy`.

    The constructor returns a strategy that has joined the job, as upstream's does: it
    has run :meth:`setup_distributed` (process group, device, world-size checks, seed),
    so ``world_size`` and ``accumulated_gradient`` are known. Pass ``defer_setup=True``
    to call :meth:`setup_distributed` yourself later (e.g. with a ``timeout``); until
    then every call that depends on the world raises :class:`NotSetUpError`.

    Args:
        config: a :class:`StrategyConfig`, an argparse namespace, a mapping, or None for
            the defaults. The original object stays available as ``strategy.args``.
            Upstream's positional form (``seed, max_norm, micro_train_batch_size,
            train_batch_size, [backend fields,] args``, see :attr:`upstream_parameters`)
            is accepted too; numbers given that way win over ``args``.
        defer_setup: do not call :meth:`setup_distributed` in the constructor.
        **overrides: fields that win over ``config`` (``seed=1``, ``zero_stage=3``...).
    """

    #: Registry name of the backend (``"fsdp2"``, ``"deepspeed"``, ``"fake"``).
    backend_name: str = ""
    #: Upstream's positional constructor parameters of this class, in order.
    upstream_parameters: tuple[str, ...] = BASE_PARAMETERS
    #: The backend component this strategy builds (``strategy.backend``).
    backend_class: ClassVar[type[Backend] | None] = None
    #: The engine link this strategy builds (``strategy.engine_link``).
    engine_link_class: ClassVar[type[EngineLink]] = EngineLink

    def __init__(self, *positional: Any, defer_setup: bool = False, **overrides: Any) -> None:
        self.config, args = config_from_constructor(
            type(self).__name__, self.upstream_parameters, positional, overrides
        )
        self.args = args if args is not None else self.config
        self.defer_setup = defer_setup
        #: What the components (backend, engine link, checkpoints) know of the run.
        self.world = World(self.config, owner=type(self).__name__)
        self._owns_process_group = False
        self._engine_ranks: engine_ranks.EngineRanks | None = None
        #: upstream's sequence-parallel data processor, the identity: the loader gives the
        #: ranks of a group the same items (rebuilt over the groups by setup_distributed)
        self.sp_data_processor = sequence_parallel.SPDataProcessor(replicated=True)
        self._dataloaders: list[weakref.ref[ResumableDataLoader]] = []
        self._pending_loader_states: list[dict[str, int]] = []
        self._optimizers: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._ema_steps: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        if self.backend_class is None:
            raise TypeError(
                f"{type(self).__name__} names no backend_class; build a strategy with "
                "lightrft.strategy.get_strategy(config), or subclass one that sets it"
            )
        #: How models are wrapped, stepped, gathered, saved and loaded on this backend.
        self.backend: Backend = self.backend_class(self.world)
        #: The rollout engine's link: setup, weight sync, generation, sleep/wake.
        self.engine_link: EngineLink = self.engine_link_class(self.world, self.backend)
        #: Saves and restores checkpoints (``save_ckpt`` / ``load_ckpt``).
        self.checkpoints = CheckpointManager(self.backend, self.backend_name, self.world)
        if not defer_setup:
            self.setup_distributed()

    @property
    def world_size(self) -> int:
        """Ranks in the job: the process group's size once set up; before that, what
        the launcher put in the environment (never a silent 1 inside a launched job)."""
        return self.world.world_size

    @property
    def launch(self) -> distributed.LaunchEnv:
        """The launcher's view of this process (rank, local rank, sizes, launcher)."""
        return self.world.launch

    @property
    def device(self) -> torch.device:
        """The device models train on (known once set up)."""
        return self.world.device

    @device.setter
    def device(self, value: torch.device) -> None:
        self.world.device = torch.device(value)

    @property
    def accumulated_gradient(self) -> int:
        """Micro-batches per optimizer step: ``train_batch_size / (micro_train_batch_size
        * dp)``, with ``dp = world_size / sp_size`` data-parallel replicas (the ranks of a
        sequence-parallel group share one micro-batch). Known once
        :meth:`setup_distributed` has run."""
        self._require_setup("accumulated_gradient")
        return self.world.accumulated_gradient

    @accumulated_gradient.setter
    def accumulated_gradient(self, value: int) -> None:
        self.world.accumulated_gradient = int(value)

    @property
    def is_ready(self) -> bool:
        """Whether :meth:`setup_distributed` has run (and :meth:`close` has not)."""
        return self.world.ready

    def _require_setup(self, what: str) -> None:
        """Raise :class:`NotSetUpError` naming ``what`` when setup has not run."""
        self.world.require_setup(what)

    # -- setup -------------------------------------------------------------------------
    def setup_distributed(
        self, timeout: datetime.timedelta | None = None, num_gpu_per_node: int | None = None
    ) -> None:
        """Join the job's process group (creating a world of one when not launched by
        torchrun/SLURM), pick the device, check world-size dependent settings, seed.

        The constructor calls it unless ``defer_setup=True``; calling it again on a
        ready strategy changes nothing (no re-seeding, no new group).
        ``num_gpu_per_node`` is accepted for upstream callers and not needed: the local
        rank comes from the launcher (``LOCAL_RANK``, or SLURM's ``SLURM_LOCALID``).
        """
        del num_gpu_per_node
        if self.world.ready:
            logger.debug("%s strategy is already set up; nothing to do", self.backend_name)
            return
        launch = distributed.LaunchEnv.from_environ()
        device = distributed.resolve_device(self.config.device)
        self.config.validate_world_size(launch.world_size)  # before any rendezvous
        if timeout is None:
            timeout = datetime.timedelta(seconds=self.config.dist_timeout_s)
        # engine_placement separate: this rank trains among the first ranks, or serves
        role = engine_ranks.Role.of(self.config, launch)
        group = None if role is None else (f"/{role.name}", role.rank, role.size)
        self._owns_process_group = distributed.init_process_group(launch, device, timeout, group)
        ranks = launch if role is None else role.launch()
        if self._owns_process_group:
            _owners.add(self)
            store = distributed.group_store("roll/" if role is None else f"roll/{role.name}/")
            if ranks.world_size > 1 and store is not None:
                roll_call.set_roll_call(
                    roll_call.RollCall(store, ranks.rank, ranks.world_size, timeout)
                )
        if role is not None and role.serves:
            engine_ranks.serve(role, device)  # until the trainers close; exits the process
        self._finish_setup(ranks, device, job_size=launch.world_size)
        if role is not None:
            self._engine_ranks = engine_ranks.EngineRanks(role, self.world, timeout, device)
            self.engine_link.remote = self._engine_ranks.remote

    def _finish_setup(
        self, launch: distributed.LaunchEnv, device: torch.device, job_size: int | None = None
    ) -> None:
        """The end of every setup, once the group is joined (or none is needed): the
        world's ranks, device and accumulation, seeding, readiness, then the backend's
        ``after_setup``. ``job_size``: the job's ranks, engine ranks included."""
        self.world.join(launch, device, job_size)
        # upstream's groups of sp_size consecutive ranks (size 1 too, as upstream's mesh)
        sequence_parallel.build_sequence_parallel_groups(self.world.sizes.sp_size)
        # the loader gives a group's ranks the same items: nothing to gather
        self.sp_data_processor = sequence_parallel.SPDataProcessor(replicated=True)
        self.set_seed(self.config.seed)
        self.world.ready, self.world.closed = True, False
        try:
            self.backend.after_setup()
        except BaseException:
            self.world.ready = False
            raise
        logger.debug(
            "%s strategy ready: rank %d/%d on %s, %d micro-batches per step",
            self.backend_name,
            self.get_rank(),
            self.world_size,
            self.device,
            self.world.accumulated_gradient,
        )

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Run operation ``what``, which talks to the other ranks: set up first, and a
        timeout or a lost rank raises :class:`~lightrft.strategy.roll_call.CollectiveError`
        naming the ranks that did not arrive (:mod:`lightrft.strategy.roll_call`)."""
        self._require_setup(what)
        with roll_call.guard(what):
            yield

    def close(self) -> None:
        """Shut the inference engine down (if one was set up), then destroy the process
        group if :meth:`setup_distributed` created it. The strategy is then no longer
        set up. The backend releases what it holds first (DeepSpeed's engines), then
        the engine goes: vLLM's shutdown tears down its own distributed state, the
        default process group included."""
        try:
            self.backend.close()
            engine, self.inference_engine = self.inference_engine, None
            if engine is not None:
                if self._owns_process_group and dist.is_initialized():
                    with roll_call.guard("close"):
                        dist.barrier()  # no rank shuts its engine down while another generates
                engine.shutdown()
            if self._owns_process_group and dist.is_initialized():
                with roll_call.guard("close"):
                    dist.barrier()
        finally:
            self._release()

    def _release(self) -> None:
        """Leave the process group and forget it, with no collective: what :meth:`close`
        ends with, and all that interpreter exit does for a strategy never closed."""
        _owners.discard(self)
        ranks, self._engine_ranks = self._engine_ranks, None
        if ranks is not None:  # the engine ranks exit (trainer rank 0 tells them)
            ranks.close()
            self.engine_link.remote = None
        if self._owns_process_group:
            roll_call.set_roll_call(None)
            if dist.is_initialized():
                self.backend.destroy_process_group()
            distributed.forget_group()
        if self.world.ready:
            sequence_parallel.set_sequence_parallel_group(None)
        self._owns_process_group = False
        if self.world.ready:
            self.world.closed = True
        self.world.ready = False

    def __enter__(self) -> StrategyBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_seed(self, seed: int) -> None:
        """Seed python, numpy (when installed) and torch on every device."""
        random.seed(seed)
        torch.manual_seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)

    # -- ranks and logging ---------------------------------------------------------------
    def get_rank(self) -> int:
        """This process's rank (0 in a world of one, such as the fake strategy's, as
        upstream's fake says)."""
        return self.world.get_rank()

    def is_rank_0(self) -> bool:
        return self.world.is_rank_0()

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for in a world of one)."""
        self.world.barrier()

    def print(self, *msg: Any) -> None:
        """Log ``msg`` at INFO on rank 0 (logger ``lightrft.strategy.print``). When the
        program configured no logging at all, the message goes to stdout."""
        if not self.is_rank_0():
            return
        if not logging.getLogger().handlers and not _print_logger.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            _print_logger.addHandler(handler)
            _print_logger.setLevel(logging.INFO)
        _print_logger.info(" ".join(str(m) for m in msg))

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, data: Any, op: collectives.ReduceOp = "mean") -> Any:
        """Reduce tensors, numbers or dicts of them over all ranks; same types back."""
        with self._collective("all_reduce"):
            return collectives.all_reduce(data, op)

    def all_gather(self, data: Any) -> Any:
        """Gather tensors (concatenated on dim 0), numbers (a list) or dicts of them."""
        with self._collective("all_gather"):
            return collectives.all_gather(data)

    # -- data ----------------------------------------------------------------------------
    def setup_dataloader(
        self,
        dataset: Any,
        batch_size: int | None = None,
        pin_memory: bool = False,
        shuffle: bool = True,
        collate_fn: Callable[..., Any] | None = None,
        drop_last: bool = True,
        sampler: Any = None,
        consumed_samples: int = 0,
        num_workers: int = 0,
    ) -> ResumableDataLoader:
        """A loader over this rank's share of ``dataset``: deterministic for the seed,
        resumable (``consumed_samples`` is a global count), saved and restored by
        :meth:`save_ckpt` / :meth:`load_ckpt`. ``batch_size`` defaults to
        ``micro_train_batch_size``."""
        self._require_setup("setup_dataloader")
        if sampler is not None:
            raise ValueError(
                "setup_dataloader builds its own resumable distributed sampler; pass "
                "shuffle/drop_last/consumed_samples instead of sampler="
            )
        # a sequence-parallel group is one data-parallel replica: its ranks get the same
        # items, which the Ulysses hook computes once, each rank holding 1/sp_size of
        # every sequence (ulysses)
        sp_size = self.world.sizes.sp_size
        loader = build_dataloader(
            dataset,
            batch_size or self.config.micro_train_batch_size,
            num_replicas=self.world_size // sp_size,
            rank=self.get_rank() // sp_size,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=drop_last,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            num_workers=num_workers,
            consumed_samples=consumed_samples,
        )
        if self._pending_loader_states:  # created after load_ckpt: resume it too
            loader.load_state_dict(self._pending_loader_states.pop(0))
        self._dataloaders.append(weakref.ref(loader))
        return loader

    def _tracked_dataloaders(self) -> list[ResumableDataLoader]:
        """Loaders made by :meth:`setup_dataloader` and still alive, in creation order."""
        return [loader for ref in self._dataloaders if (loader := ref()) is not None]

    def _restore_dataloader_states(self, states: list[dict[str, int]]) -> None:
        """Give saved loader states to the loaders, by creation order. Loaders created
        after the checkpoint was loaded take the states left over, in order."""
        loaders = self._tracked_dataloaders()
        for loader, state in zip(loaders, states, strict=False):
            loader.load_state_dict(state)
        self._pending_loader_states = list(states[len(loaders) :])
        if len(loaders) > len(states):
            logger.warning(
                "%d data loader(s) exist but the checkpoint holds %d loader state(s); the "
                "extra loaders start from the beginning",
                len(loaders),
                len(states),
            )

    # -- optimizers and models -----------------------------------------------------------
    def create_optimizer(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        """AdamW over ``model`` with weight decay on weights only (not biases or norms).

        ``lr`` defaults to ``actor_learning_rate``, ``betas`` to ``adam_betas`` and
        ``weight_decay`` to ``l2``; other keyword arguments go to the optimizer.
        """
        self._require_setup("create_optimizer")
        model = self.backend.model_for_optimizer(training_module(model))
        lr = kwargs.pop("lr", self.config.actor_learning_rate)
        betas = tuple(kwargs.pop("betas", self.config.adam_betas))
        weight_decay = kwargs.pop("weight_decay", self.config.l2)
        groups = parameter_groups(self.unwrap_model(model), weight_decay)
        optimizer = self.backend.build_optimizer(
            groups, lr=lr, betas=(betas[0], betas[1]), **kwargs
        )
        self._optimizers[model] = (optimizer, None)  # save_ckpt(model) finds it
        return optimizer

    def create_scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int) -> Any:
        """The configured warmup + ``lr_scheduler`` schedule over ``max_steps`` steps."""
        scheduler = build_scheduler(optimizer, self.config, max_steps)
        for model, (paired, _) in list(self._optimizers.items()):
            if paired is optimizer:
                self._optimizers[model] = (optimizer, scheduler)
        return scheduler

    def prepare(self, *models_or_model_optim_pairs: Any, is_rlhf: bool = False) -> Any:
        """Wrap each ``(model, optimizer, scheduler)`` triple for training and each plain
        model for evaluation; a list or tuple of models is prepared as reward models
        (:meth:`prepare_reward_models`), a triple whose model is ``None`` gives
        ``(None, None, None)`` and ``None`` passes through. One argument gives one
        result, several give a list, as upstream."""
        self._require_setup("prepare")
        results: list[Any] = []
        for item in models_or_model_optim_pairs:
            if item is None:
                results.append(None)
            elif isinstance(item, tuple | list) and all(isinstance(m, nn.Module) for m in item):
                results.append(self.prepare_reward_models(item))  # upstream: reward models
            elif isinstance(item, tuple | list) and len(item) == 3 and item[0] is None:
                results.append((None, None, None))  # an absent critic
            elif isinstance(item, tuple | list):
                if len(item) != 3:
                    raise ValueError(
                        f"prepare takes (model, optimizer, scheduler) triples, got a "
                        f"{len(item)}-tuple"
                    )
                model, optimizer, scheduler = item
                inner, optimizer, scheduler = self.backend.prepare_train(
                    self._split_sequences(training_module(model)), optimizer, scheduler
                )
                self._optimizers[inner] = (optimizer, scheduler)
                results.append((_put_back(model, inner), optimizer, scheduler))
            else:
                results.append(self.prepare_model(item, is_training=False))
        return results[0] if len(results) == 1 else results

    def prepare_model(
        self,
        model: nn.Module,
        is_training: bool = False,
        shard_size: int | str | None = None,
        reshard_after_forward: bool | None = None,
    ) -> nn.Module:
        """Wrap one model without an optimizer (reference, reward or EMA models).

        ``shard_size`` and ``reshard_after_forward`` (upstream FSDP's arguments) set this
        model's FSDP2 layout instead of ``fsdp_shard_size`` /
        ``fsdp_reshard_after_forward``; other backends have no such layout and ignore
        them. ``None`` passes through, as upstream."""
        self._require_setup("prepare_model")
        if model is None:
            return model
        if shard_size == "auto" and is_training:  # upstream: trained models shard fully
            shard_size = -1
        with self.backend.model_layout(shard_size, reshard_after_forward):
            inner = self._split_sequences(training_module(model))
            if is_training:
                return _put_back(model, self.backend.prepare_train_model(inner))
            return _put_back(model, self.backend.prepare_eval(inner))

    def _split_sequences(self, model: nn.Module) -> nn.Module:
        """At ``sp_size > 1``, Ulysses attention on ``model``'s decoder (checked before
        any wrapping: an unsupported model or head count fails here)."""
        if sequence_parallel.get_sequence_parallel_world_size() > 1:
            ulysses.apply_ulysses(model, sequence_parallel.get_sequence_parallel_group())
        return model

    def prepare_models_and_optimizers(
        self,
        actor: nn.Module,
        critic: nn.Module | None,
        reward_models: Any,
        initial_model: nn.Module | None,
        args: Any = None,
        max_steps: int = 1,
    ) -> tuple[Triple, tuple[Any, Any, Any], Any, Any]:
        """Build optimizers and schedules for the actor and the critic, then prepare all.

        Returns ``(actor, actor_optim, actor_sched), (critic, critic_optim,
        critic_sched), reward_models, initial_model``; a missing critic gives
        ``(None, None, None)``; ``reward_models`` keeps its shape (one model or a list).
        Learning rates come from ``args`` when given, else from this strategy's config.
        """
        self._require_setup("prepare_models_and_optimizers")
        config = self.config if args is None else StrategyConfig.from_args(args)
        if is_actor(actor):
            setattr(actor, "is_actor", True)  # noqa: B010 as upstream: its .model is what is trained and synced

        actor_triple = self._train_triple(actor, config, config.actor_learning_rate, max_steps)
        critic_triple: tuple[Any, Any, Any] = (
            self._train_triple(critic, config, config.critic_learning_rate, max_steps)
            if critic is not None
            else (None,) * 3
        )
        if isinstance(reward_models, list | tuple):
            rewards: Any = self.prepare_reward_models(reward_models)
        elif isinstance(reward_models, nn.Module):
            rewards = self.prepare_model(reward_models)
        else:  # None, or a remote reward: passes through
            rewards = reward_models
        initial = self.prepare_model(initial_model) if initial_model is not None else None
        return actor_triple, critic_triple, rewards, initial

    def prepare_reward_models(self, reward_models: Any) -> list[Any]:
        """Wrap each reward model for inference, as upstream's DeepSpeed backend does;
        entries that are not modules (``None``, remote rewards) pass through."""
        self._require_setup("prepare_reward_models")
        return [self.prepare_model(m) if isinstance(m, nn.Module) else m for m in reward_models]

    def prepare_reward_model(
        self, reward_model: nn.Module, args: Any = None, max_steps: int = int(1e8)
    ) -> Triple:
        """Prepare a reward model for *training* (upstream's reward-model trainers):
        returns ``(model, optimizer, scheduler)`` with ``actor_learning_rate``,
        ``adam_betas``, ``l2`` and the configured schedule over ``max_steps``, all read
        from ``args`` when given, else from this strategy's config."""
        self._require_setup("prepare_reward_model")
        config = self.config if args is None else StrategyConfig.from_args(args)
        return self._train_triple(reward_model, config, config.actor_learning_rate, max_steps)

    def _train_triple(
        self, model: nn.Module, config: StrategyConfig, lr: float, max_steps: int
    ) -> Triple:
        inner = self.backend.prepare_train_model(self._split_sequences(training_module(model)))
        optimizer = self.create_optimizer(
            inner, lr=lr, betas=config.adam_betas, weight_decay=config.l2
        )
        scheduler = build_scheduler(optimizer, config, max_steps)
        prepared: Triple = self.prepare((_put_back(model, inner), optimizer, scheduler))
        return prepared

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper (``.module`` chains); for upstream's actor
        wrapper, the Hugging Face model in its ``.model``, as upstream DeepSpeed's."""
        return unwrap_model(model)

    def step_state(self, model: nn.Module) -> StepState:
        """Counters of ``model``'s optimisation: micro/global/skipped steps, last norm."""
        return self.world.step_state(model)

    # -- training steps ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: Any, **kwargs: Any) -> None:
        """Backpropagate ``loss / accumulated_gradient`` (gradients reduced over the
        data-parallel ranks on the last micro-step of an accumulation); while a
        :meth:`plan_micro_batches` plan runs, ``loss`` / its number of micro-batches."""
        with self._collective("backward"):
            self.backend.backward(loss, training_module(model), optimizer, **kwargs)

    def plan_micro_batches(
        self, lengths: Sequence[int], loss_tokens: Sequence[int] | None = None
    ) -> StepPlan:
        """Split this step's samples (their token ``lengths`` on this rank; every rank
        calls this together) into micro-batches: packed under ``max_tokens_per_gpu``
        with ``packing_samples``, else fixed ones of ``micro_train_batch_size``; the
        same number on every rank. Until the plan ends (``with plan:``, or
        ``plan.finish()``), :meth:`backward` and :meth:`optimizer_step` accumulate over
        exactly its micro-batches. ``loss_tokens`` (the completion's tokens per sample;
        default: every token) sets :meth:`StepPlan.loss`'s normalisation. See
        :mod:`lightrft.strategy.micro_batches`."""
        with self._collective("plan_micro_batches"):
            previous = self.world.plan
            if previous is not None:
                previous.finish()
            unfinished = self.world.step_states.unfinished()
            if unfinished:
                raise PlanError(
                    f"plan_micro_batches: {unfinished} micro-step(s) run since the last "
                    "optimizer step; plan a step after the accumulation under way ends"
                )
            plan = make_plan(self.world, lengths, loss_tokens)
            self.world.plan = plan
            return plan

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        scheduler: Any = None,
        name: str = "model",
        **kwargs: Any,
    ) -> bool:
        """Count a micro-step; on the last of ``accumulated_gradient`` clip to
        ``max_norm``, check the norm and step the optimizer and ``scheduler`` (DeepSpeed:
        the scheduler given to :meth:`prepare`). Returns whether the optimizer stepped
        (False between accumulation boundaries and when a non-finite gradient norm
        skipped the step, which :meth:`step_state` records)."""
        with self._collective("optimizer_step"):
            return self.backend.optimizer_step(
                optimizer, training_module(model), scheduler, name, **kwargs
            )

    # -- optimizer offload ---------------------------------------------------------------
    def maybe_offload_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Move optimizer state to CPU memory (when ``adam_offload`` is off and the state
        lives on an accelerator); :meth:`maybe_load_optimizer` moves it back. Returns
        ``optimizer`` (as upstream's fake)."""
        self.backend.offload_optimizer(optimizer)
        return optimizer

    def maybe_load_optimizer(
        self, optimizer: torch.optim.Optimizer, device: torch.device | str | None = None
    ) -> torch.optim.Optimizer:
        """Move optimizer state back to ``device`` (default: this rank's device); returns
        ``optimizer``."""
        self.backend.load_optimizer(optimizer, torch.device(device) if device else self.device)
        return optimizer

    # -- model offload -------------------------------------------------------------------
    def offload_model(self, models: nn.Module | list[nn.Module], empty_cache: bool = True) -> None:
        """Move the weights and gradients of ``models`` (one model or a list, as
        upstream FSDP) to CPU memory, e.g. while an inference engine on the same
        accelerator generates; :meth:`reload_model` moves them back. Nothing to do on a
        CPU job."""
        if self.device.type == "cuda":
            for model in models if isinstance(models, list | tuple) else [models]:
                self.backend.move_model(training_module(model), torch.device("cpu"))
            if empty_cache:
                torch.cuda.empty_cache()

    def reload_model(self, models: nn.Module | list[nn.Module]) -> None:
        if self.device.type == "cuda":
            for model in models if isinstance(models, list | tuple) else [models]:
                self.backend.move_model(training_module(model), self.device)

    # -- memory --------------------------------------------------------------------------
    def report_memory(self, prefix: str = "") -> dict[str, float]:
        """Memory in GiB (accelerator allocated/reserved/peak when on CUDA, and the
        process's peak resident set on every device), logged on rank 0 and returned."""
        gib = 2**30
        figures: dict[str, float] = {}
        if self.device.type == "cuda":
            figures["allocated_gib"] = torch.cuda.memory_allocated() / gib
            figures["reserved_gib"] = torch.cuda.memory_reserved() / gib
            figures["max_allocated_gib"] = torch.cuda.max_memory_allocated() / gib
        with contextlib.suppress(ImportError):
            import resource

            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            figures["cpu_max_rss_gib"] = kib * 1024 / gib
        text = ", ".join(f"{k}={v:.3f}" for k, v in figures.items())
        self.print(f"{prefix} memory: {text}".strip())
        return figures

    def sync_and_clear_cache(self) -> None:
        """Wait for the device, then free cached memory (python garbage, CUDA cache)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # -- model state -----------------------------------------------------------------------
    def init_model_context(self, meta_init: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Context in which to build models: at ZeRO-3 they are partitioned as built;
        with ``meta_init`` ranks other than 0 build on the meta device and take rank
        0's weights when prepared (see the backend's docstring)."""
        self._require_setup("init_model_context")
        return self.backend.init_model_context(meta_init)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights of ``model`` on CPU: complete on rank 0, maybe
        empty elsewhere. Collective: every rank must call it."""
        self._require_setup("full_state_dict")
        return self.backend.full_state_dict(training_module(model))

    def full_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each parameter's whole gradient on every rank (copies, on the model's device),
        read after a step's last ``backward`` and before its ``optimizer_step``: summed
        over the step's micro-batches and reduced over the data-parallel ranks, as the
        optimizer will see it. Parameters without a gradient are left out. Collective."""
        self._require_setup("full_gradients")
        return self.backend.full_gradients(training_module(model))

    def save_model(
        self,
        model: nn.Module,
        tokenizer: Any,
        output_dir: str | Path,
        merge_lora: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write ``model`` in Hugging Face format (``*.safetensors``, config.json,
        tokenizer files) to ``output_dir`` on rank 0. Collective. A peft LoRA model is
        written as its adapter in peft's format (as upstream's DeepSpeed backend saves
        it), or with ``merge_lora`` as the merged model in Hugging Face format."""
        self._require_setup("save_model")
        from lightrft.strategy.hf_export import write_hf_checkpoint

        model = training_module(model)  # upstream's actor: its Hugging Face model

        state = self.backend.full_state_dict(model)
        module = self.unwrap_model(model)
        if self.is_rank_0():
            if lora.is_lora_model(module):
                lora.write_lora_model(module, state, Path(output_dir), tokenizer, merge=merge_lora)
            else:
                write_hf_checkpoint(state, module, Path(output_dir), tokenizer, **kwargs)
        self.barrier()

    def load_model(
        self,
        model: nn.Module,
        path: str | Path,
        map_location: Any = "cpu",
        strict: bool = False,
        key_replace_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Load weights from ``path`` into ``model``, prepared or not (upstream's
        signature). ``path`` is a state dict saved with ``torch.save`` (read with
        ``weights_only=True``), a ``.safetensors`` file or a Hugging Face model
        directory; ``key_replace_fn`` may rename the keys first. Every rank reads the
        file. Collective on sharded models.

        Names are checked before anything is loaded: with ``strict`` any missing or
        unexpected name raises :class:`~lightrft.strategy.CheckpointError` naming them;
        without it they are logged, and a file sharing no name with the model raises.
        """
        from lightrft.strategy.checkpoint.layout import CheckpointError
        from lightrft.strategy.weight_files import read_weights
        from lightrft.strategy.weight_files import some_names as shown

        self._require_setup("load_model")
        model = training_module(model)
        state = read_weights(path, map_location)
        if key_replace_fn is not None:
            state = key_replace_fn(state)
        expected = set(self.unwrap_model(model).state_dict())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if (strict and (missing or unexpected)) or len(unexpected) == len(state):
            raise CheckpointError(
                f"load_model: {path} does not fit {type(self.unwrap_model(model)).__name__}: "
                f"{len(missing)} missing name(s) [{shown(missing)}], {len(unexpected)} "
                f"unexpected [{shown(unexpected)}]. Rename keys with key_replace_fn"
                + ("" if not strict else ", or pass strict=False to load the matching ones")
                + "; nothing was loaded"
            )
        if missing or unexpected:
            logger.warning(
                "load_model(%s): %d model name(s) not in the file [%s], %d file name(s) not "
                "in the model [%s]",
                path, len(missing), shown(missing), len(unexpected), shown(unexpected),
            )  # fmt: skip
        self.backend.load_full_weights(model, {k: v for k, v in state.items() if k in expected})
        self.step_state(model).weight_changes += 1

    def moving_average(
        self, model: nn.Module, model_ema: nn.Module, beta: float = 0.992, device: str = "cpu"
    ) -> bool:
        """``ema = beta * ema + (1 - beta) * model`` over parameters, at most once per
        optimizer step of ``model``: calling it after every micro-batch (as upstream's
        trainers do, and upstream's DeepSpeed backend counts for) updates once per
        step, and a step skipped for a non-finite gradient does not update. A model
        that :meth:`optimizer_step` never stepped updates on every call. Returns
        whether it updated. ``device`` is accepted for upstream callers; the EMA stays
        where ``model_ema`` lives."""
        self._require_setup("moving_average")
        del device
        model, model_ema = training_module(model), training_module(model_ema)
        steps = self.step_state(model)
        ema = self.unwrap_model(model_ema)
        if steps.micro_steps and self._ema_steps.get(ema, 0) >= steps.global_steps:
            return False
        self.backend.update_ema(model, model_ema, beta)
        self.step_state(model_ema).weight_changes += 1
        self._ema_steps[ema] = steps.global_steps
        return True

    # -- the rollout engine (upstream's names and ours; its other calls: upstream_names) ----
    def update_engine_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        name_map: Callable[[str], str | None] | None = None,
        dtype: torch.dtype | None = None,
        verify: bool | None = None,
        skip_unchanged: bool = False,
    ) -> dict[str, Any]:
        """Send ``model``'s full weights to the engine (with ``skip_unchanged``, nothing
        when the engine holds them already); see
        :meth:`~lightrft.strategy.engine_link.weight_sync.WeightSync.update_engine_weights`.
        Collective."""
        return self.engine_link.weight_sync.update_engine_weights(
            model, bucket_bytes=bucket_bytes, name_map=name_map, dtype=dtype, verify=verify,
            skip_unchanged=skip_unchanged,
        )  # fmt: skip

    def verify_engine_weights(
        self,
        model: nn.Module,
        *,
        probe: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        tolerance: float | None = None,
    ) -> dict[str, Any]:
        """Check that the engine computes with ``model``'s weights (collective); see
        :meth:`~lightrft.strategy.engine_link.weight_sync.WeightSync.verify_engine_weights`."""
        return self.engine_link.weight_sync.verify_engine_weights(
            model, probe=probe, max_new_tokens=max_new_tokens, tolerance=tolerance
        )

    def maybe_sleep_inference_engine(self) -> bool:
        """Put the engine to sleep when ``enable_engine_sleep`` is set; returns whether
        it slept."""
        return self.engine_link.sleep.maybe_sleep()

    def wakeup_inference_engine(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: both) when
        ``enable_engine_sleep`` is set."""
        self.engine_link.sleep.wake_up(tags)

    def engine_generate_local(
        self,
        sampling_params: Any,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        multi_modal_inputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate on this rank's engine alone, without gathering: exactly one of
        ``prompt_token_ids`` and ``multi_modal_inputs``."""
        return self.engine_link.generation.generate_local(
            sampling_params, prompt_token_ids, multi_modal_inputs
        )

    def submit_generation(
        self, prompts: Sequence[Any], sampling: Any = None, sleep_engine: bool = False
    ) -> None:
        """Hand the next step's prompts to the engine before training on this one
        (:mod:`~lightrft.strategy.engine_link.submitted`): engine ranks of their own
        with ``max_staleness >= 1`` start generating at once; otherwise generation
        waits for :meth:`collect_generation`, from the newest weights. Collective."""
        self.engine_link.submitted.submit(prompts, sampling, sleep_engine)

    def collect_generation(self) -> list[GenerationOutput]:
        """This rank's outputs of the submitted prompts, each with the
        ``weight_version`` that generated it, from weights at most ``max_staleness``
        optimizer steps old. Collective."""
        return self.engine_link.submitted.collect()

    def rollout_lag(self, outputs: Sequence[GenerationOutput]) -> int:
        """Optimizer steps between the trainer's weights and the oldest weights that
        generated ``outputs`` on any rank (the demo's ``weight_lag``). Collective."""
        return self.engine_link.submitted.lag(outputs)

    # -- checkpoints -----------------------------------------------------------------------
    def save_ckpt(
        self,
        model: nn.Module,
        save_dir: str | Path,
        tag: str | None = None,
        max_num: int | None = None,
        max_mem: float | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        optimizer: Any = None,
        scheduler: Any = None,
        tokenizer: Any = None,
    ) -> Path:
        """Save everything needed to resume: model, its optimizer and scheduler (those
        given to :meth:`prepare`, or passed here), every rank's RNG, the state of loaders
        from :meth:`setup_dataloader`, and ``client_state``. Collective.

        ``tag`` defaults to ``global_step<N>``; rotation keeps ``max_num`` (default
        ``max_ckpt_num``) checkpoints within ``max_mem`` GiB (default ``max_ckpt_mem``).
        ``tokenizer`` (a transformers tokenizer or processor: anything with
        ``save_pretrained``) is saved by rank 0 into the tag's ``tokenizer/`` directory,
        which ``lightrft ckpt export`` writes beside the weights.
        """
        with self._collective("save_ckpt"):
            return self.checkpoints.save(
                self._checkpoint_subject(model, optimizer, scheduler), Path(save_dir), tag,
                max_num=max_num, max_gib=max_mem, client_state=client_state,
                update_latest=save_latest, tokenizer=tokenizer,
            )  # fmt: skip

    def load_ckpt(
        self,
        model: nn.Module,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> tuple[str, dict[str, Any]]:
        """Restore what :meth:`save_ckpt` saved; returns ``(path, client_state)``.

        Raises :class:`~lightrft.strategy.checkpoint.CheckpointError` subclasses when no
        checkpoint exists, when it is incomplete or truncated, or when another backend
        wrote it; nothing is loaded in those cases.
        """
        with self._collective("load_ckpt"):
            return self.checkpoints.load(
                self._checkpoint_subject(model, optimizer, scheduler), Path(load_dir), tag,
                strict=load_module_strict, optimizer=load_optimizer_states,
                scheduler=load_lr_scheduler_states, module_only=load_module_only,
            )  # fmt: skip

    def _checkpoint_subject(
        self, model: nn.Module, optimizer: Any, scheduler: Any
    ) -> CheckpointSubject:
        """What a checkpoint of ``model`` holds: the model, the optimizer and scheduler
        given (else those :meth:`prepare` paired with it), its step counters and the
        loaders from :meth:`setup_dataloader`."""
        model = training_module(model)
        paired_optimizer, paired_scheduler = self._optimizers.get(model, (None, None))
        submitted, steps = self.engine_link.submitted, self.step_state(model)
        return CheckpointSubject(
            model=model,
            module=self.unwrap_model(model),
            optimizer=optimizer if optimizer is not None else paired_optimizer,
            scheduler=scheduler if scheduler is not None else paired_scheduler,
            steps=steps,
            loaders=self._tracked_dataloaders(),
            restore_loaders=self._restore_dataloader_states,
            hold_rollouts=submitted.hold,
            restore_rollouts=lambda held: submitted.restore(held, steps.weight_changes),
        )

    def optimizer_of(self, model: nn.Module) -> tuple[Any, Any]:
        """The (optimizer, scheduler) :meth:`prepare` paired with ``model``, or Nones."""
        return self._optimizers.get(training_module(model), (None, None))


def _put_back(model: nn.Module, prepared: nn.Module) -> nn.Module:
    """Upstream's actor wrapper gets its prepared ``.model`` back and is returned; any
    other model is replaced by its prepared form."""
    if is_actor(model) and prepared is not model:
        model.model = prepared
        return model
    return prepared


# The strategies that created the process group they hold. At interpreter exit, one that
# was never closed leaves its group while the interpreter is whole: a gloo group
# destroyed during finalisation can abort the process (pytorch/pytorch#190489).
_owners: weakref.WeakSet[StrategyBase] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    for strategy in list(_owners):
        with contextlib.suppress(Exception):
            strategy.backend.close()
            engine, strategy.inference_engine = strategy.inference_engine, None
            if engine is not None:
                engine.shutdown()
        strategy._release()
    distributed.release_job_stores()
    # closed or not: a gloo worker still releasing a finished collective's tensors when
    # finalisation begins aborts the process (see collective_threads)
    collective_threads.wait_until_idle()
