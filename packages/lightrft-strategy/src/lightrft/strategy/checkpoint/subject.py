"""What the checkpoint manager is handed: the pieces it saves and restores
(:class:`CheckpointSubject`, built by the strategy in ``save_ckpt`` / ``load_ckpt``) and
the backend's state hooks (:class:`CheckpointBackend`); its ranks and collectives are
the strategy's :class:`~lightrft.strategy.world.World`. The checkpoint package imports
nothing of the strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from lightrft.strategy.data import ResumableDataLoader
    from lightrft.strategy.stepping import StepState

__all__ = ["CheckpointBackend", "CheckpointSubject"]


@dataclass
class CheckpointSubject:
    """One model's training state, as a checkpoint holds it."""

    #: The prepared model (a DeepSpeed engine, an FSDP2 module), as the backend saves it.
    model: nn.Module
    #: The user's module inside it: its parameter names, config and layout are recorded.
    module: nn.Module
    optimizer: Any
    scheduler: Any
    #: The model's step counters (saved, and restored in place).
    steps: StepState
    #: The loaders to save, in creation order.
    loaders: list[ResumableDataLoader]
    #: Gives saved loader states back to the loaders (and keeps the rest for loaders made
    #: later).
    restore_loaders: Callable[[list[dict[str, int]]], None]
    #: This rank's rollouts in flight, collected for the checkpoint as plain values
    #: (None: nothing in flight). Collective.
    hold_rollouts: Callable[[], dict[str, Any] | None] = lambda: None
    #: Gives held rollouts back after a load (None: the checkpoint held none).
    restore_rollouts: Callable[[dict[str, Any] | None], None] = lambda held: None


class CheckpointBackend(Protocol):
    """The backend's part of a checkpoint (:class:`~lightrft.strategy.backend.Backend`)."""

    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None: ...

    def load_state(
        self, model: nn.Module, optimizer: Any, directory: Path, strict: bool
    ) -> None: ...

    def checkpoint_info(self) -> dict[str, Any]: ...

    def optimizer_param_groups(
        self, model: nn.Module, optimizer: Any
    ) -> list[list[Any]] | None: ...
