"""`Backend`: what a distributed backend (FSDP2, DeepSpeed, the fake) implements.

A strategy holds one as ``strategy.backend``; :class:`~lightrft.strategy.StrategyBase`
owns the lifecycle and the training API and calls the backend for what differs between
backends: how models are built, wrapped for training and evaluation, stepped, moved
between devices, and how their full weights and checkpoint state are gathered, saved and
loaded. A backend author writes the abstract methods and overrides what else differs;
the defaults are those of a model that is not sharded (plain autograd, torch's AdamW).

A backend is given the strategy's :class:`~lightrft.strategy.world.World` (config,
device, ranks, accumulation, step counters, collectives), never the strategy itself, so
it can be built and tested without one. What a strategy of a backend needs beyond these
methods (FSDP2's ``mesh``, DeepSpeed's ``train_config()``/``eval_config()``) it reads
from the backend's documented members.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.strategy.actor import unwrap_model
from lightrft.strategy.optim import build_adamw
from lightrft.strategy.stepping import clip_and_check, record_skip

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.strategy.world import World

__all__ = ["Backend", "Triple"]

Triple = tuple[nn.Module, torch.optim.Optimizer, Any]


class Backend(ABC):
    """The backend of one strategy. Built by the strategy (``backend_class(world)``)
    before its setup; :meth:`after_setup` runs once the process group is joined."""

    def __init__(self, world: World) -> None:
        self.world = world

    @property
    def config(self) -> StrategyConfig:
        return self.world.config

    @property
    def device(self) -> torch.device:
        return self.world.device

    # -- lifecycle -----------------------------------------------------------------------
    def after_setup(self) -> None:  # noqa: B027 a hook with nothing to do by default
        """Run at the end of ``setup_distributed`` (the process group is joined)."""

    def close(self) -> None:  # noqa: B027 a hook with nothing to do by default
        """Release what the backend holds; run by ``strategy.close()`` before it shuts
        the engine down and leaves the process group."""

    def destroy_process_group(self) -> None:
        """Leave the process group the strategy created (every group goes with it)."""
        dist.destroy_process_group()

    # -- building and wrapping -----------------------------------------------------------
    @abstractmethod
    def init_model_context(self, meta_init: bool = False) -> contextlib.AbstractContextManager[Any]:
        """Context in which to build models; ``meta_init`` defers allocation where the
        backend can load the weights afterwards."""

    def model_layout(
        self, shard_size: int | str | None, reshard_after_forward: bool | None
    ) -> contextlib.AbstractContextManager[Any]:
        """A context in which models are wrapped with this layout (FSDP2's shard groups;
        other backends have none)."""
        del shard_size, reshard_after_forward
        return contextlib.nullcontext()

    def model_for_optimizer(self, model: nn.Module) -> nn.Module:
        """The module whose parameters the optimizer must hold."""
        return model

    def build_optimizer(
        self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """The Adam implementation (torch's AdamW by default)."""
        return build_adamw(groups, lr=lr, betas=betas, **kwargs)

    @abstractmethod
    def prepare_train(self, model: nn.Module, optimizer: Any, scheduler: Any) -> Triple:
        """Wrap a model with its optimizer and scheduler for training."""

    @abstractmethod
    def prepare_train_model(self, model: nn.Module) -> nn.Module:
        """Wrap a model for training whose optimizer is created afterwards."""

    @abstractmethod
    def prepare_eval(self, model: nn.Module) -> nn.Module:
        """Wrap a model for inference only."""

    # -- steps ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: Any, **kwargs: Any) -> None:
        """Backpropagate ``loss / accumulation`` (``model`` is the training module, not
        upstream's actor wrapper; the accumulation is the planned step's micro-batches
        while a plan runs, else ``accumulated_gradient``)."""
        del optimizer
        state = self.world.step_state(model)
        self.before_backward(model, is_last_micro_step=self.world.closes_accumulation(state))
        (loss / self.world.accumulation).backward(**kwargs)  # type: ignore[no-untyped-call]

    def before_backward(  # noqa: B027 a hook with nothing to do by default
        self, model: nn.Module, is_last_micro_step: bool
    ) -> None:
        """Run before each backward (FSDP2 skips gradient sync on all but the last
        micro-step)."""

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        scheduler: Any = None,
        name: str = "model",
        **kwargs: Any,
    ) -> bool:
        """Count a micro-step; on the last of ``accumulated_gradient`` clip to
        ``max_norm``, skip a non-finite norm, step the optimizer and scheduler. Returns
        whether the optimizer stepped."""
        del kwargs
        state = self.world.step_state(model)
        closes = self.world.closes_accumulation(state)
        state.micro_steps += 1
        state.accumulated += 1
        if not closes:
            return False
        state.accumulated = 0
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = clip_and_check(params, self.config.max_norm)
        state.last_grad_norm = norm
        if not math.isfinite(norm):
            record_skip(state, norm, name)
            optimizer.zero_grad(set_to_none=True)
            return False
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.global_steps += 1
        state.weight_changes += 1
        return True

    # -- moving state between devices ------------------------------------------------------
    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Move optimizer state to CPU memory (``maybe_offload_optimizer``)."""
        self._move_optimizer_state(optimizer, torch.device("cpu"))

    def load_optimizer(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """Move optimizer state back to ``device`` (``maybe_load_optimizer``)."""
        self._move_optimizer_state(optimizer, device)

    def _move_optimizer_state(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        if self.config.adam_offload:  # the optimizer keeps its state in CPU memory itself
            return
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def move_model(self, model: nn.Module, device: torch.device) -> None:
        """Move a model's weights (and gradients) to ``device``; the default moves the
        module."""
        unwrap_model(model).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()

    # -- full weights ----------------------------------------------------------------------
    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded state dict on CPU (complete on rank 0; may be empty elsewhere).
        Collective: every rank must call it."""

    def iter_full_parameters(
        self, model: nn.Module, select: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` per parameter, in the same order on every rank
        (collective for sharded parameters); with ``select``, only the parameters whose
        names it accepts (the others are not gathered; it must answer alike on every
        rank). Each tensor stays valid while the model is not stepped (a gathered copy,
        or the parameter itself): a weight sync sends them without copying again."""
        for name, param in unwrap_model(model).named_parameters():
            if select is None or select(name):
                yield name, param.detach()

    def full_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each parameter's whole gradient (a copy) on every rank; collective."""
        return {
            name: param.grad.detach().clone()
            for name, param in unwrap_model(model).named_parameters()
            if param.grad is not None
        }

    def load_full_weights(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Copy full (unsharded) tensors, all of whose names the model has, into
        ``model``. The default copies into the unwrapped module's tensors."""
        unwrap_model(model).load_state_dict(state, strict=False)

    @abstractmethod
    def update_ema(self, model: nn.Module, model_ema: nn.Module, beta: float) -> None:
        """``ema = beta * ema + (1 - beta) * model`` over parameters, now."""

    # -- checkpoints -------------------------------------------------------------------------
    def optimizer_param_groups(self, model: nn.Module, optimizer: Any) -> list[list[Any]] | None:
        """The parameters of each of ``optimizer``'s groups, in its order, as the model
        holds them (recorded by name in checkpoints); None when it cannot tell."""
        del model
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            return None
        return [list(group["params"]) for group in groups]

    def checkpoint_info(self) -> dict[str, Any]:
        """Facts recorded in a checkpoint's metadata that decide whether it can be loaded
        (DeepSpeed: the ZeRO stage). Plain JSON values."""
        return {}

    @abstractmethod
    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None:
        """Write model (and optimizer) state into ``directory``. Collective."""

    @abstractmethod
    def load_state(self, model: nn.Module, optimizer: Any, directory: Path, strict: bool) -> None:
        """Read what :meth:`save_state` wrote. Collective."""
