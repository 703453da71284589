"""Upstream LightRFT's read-only strategy attributes (``strategy.bf16``,
``strategy.zpg``, ...), each the configuration's field of the same name. Kept apart
from :class:`~lightrft.strategy.StrategyBase`'s own API, which mixes them in, so that
they read as what they are: names for upstream's callers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig


class UpstreamAttributes:
    """Mixed into :class:`~lightrft.strategy.StrategyBase`."""

    if TYPE_CHECKING:
        config: StrategyConfig

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def max_norm(self) -> float:
        return self.config.max_norm

    @property
    def micro_train_batch_size(self) -> int:
        return self.config.micro_train_batch_size

    @property
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def bf16(self) -> bool:
        return self.config.bf16

    @property
    def adam_offload(self) -> bool:
        return self.config.adam_offload

    @property
    def zpg(self) -> int:
        return self.config.zpg

    @property
    def grad_accum_dtype(self) -> str | None:
        return self.config.grad_accum_dtype

    @property
    def overlap_comm(self) -> bool:
        return self.config.overlap_comm

    @property
    def engine_type(self) -> str:
        return self.config.engine_type
