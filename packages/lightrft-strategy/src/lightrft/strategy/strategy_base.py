"""Upstream LightRFT's path ``lightrft.strategy.strategy_base`` (compatibility only; the
names live in :mod:`lightrft.strategy.base` and :mod:`lightrft.strategy.actor`)."""

from lightrft.strategy.actor import is_actor
from lightrft.strategy.base import StrategyBase

__all__ = ["StrategyBase", "is_actor"]
