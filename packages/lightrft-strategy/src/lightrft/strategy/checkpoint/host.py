"""What the checkpoint manager needs from the strategy that calls it: the
:class:`CheckpointHost` protocol. The manager is typed against this, not against
``StrategyBase``, so the checkpoint package imports nothing of the strategy's class and
a reader sees the fifteen members a checkpoint touches: the ranks and their
collectives, the backend's own state and description, the model's optimizer pairing,
step counters and parameter groups, and the data loaders to resume."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.strategy.collectives import ReduceOp
    from lightrft.strategy.data import ResumableDataLoader
    from lightrft.strategy.stepping import StepState

__all__ = ["CheckpointHost"]


class CheckpointHost(Protocol):
    """The strategy, as :func:`~lightrft.strategy.checkpoint.manager.save_checkpoint`
    and :func:`~lightrft.strategy.checkpoint.manager.load_checkpoint` use it."""

    #: ``max_ckpt_num`` and ``max_ckpt_mem`` (rotation).
    config: StrategyConfig
    #: Recorded in the metadata; a checkpoint of another backend is refused.
    backend_name: str

    # -- ranks ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int: ...

    def get_rank(self) -> int: ...

    def barrier(self) -> None: ...

    def all_reduce(self, data: Any, op: ReduceOp = "mean") -> Any: ...

    # -- the backend's own state (its hooks) --------------------------------------------
    def save_backend_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None: ...

    def load_backend_state(
        self, model: nn.Module, optimizer: Any, directory: Path, strict: bool
    ) -> None: ...

    def checkpoint_info(self) -> dict[str, Any]: ...

    # -- what the strategy knows of the model -------------------------------------------
    def unwrap_model(self, model: nn.Module) -> nn.Module: ...

    def optimizer_of(self, model: nn.Module) -> tuple[Any, Any]: ...

    def optimizer_param_groups(
        self, model: nn.Module, optimizer: Any
    ) -> list[list[Any]] | None: ...

    def step_state(self, model: nn.Module) -> StepState: ...

    # -- the data loaders to resume ------------------------------------------------------
    def tracked_dataloaders(self) -> list[ResumableDataLoader]: ...

    def restore_dataloader_states(self, states: list[dict[str, int]]) -> None: ...
