"""Upstream LightRFT's path ``lightrft.strategy.strategy`` (compatibility only; the
names live in :mod:`lightrft.strategy.registry` and :mod:`lightrft.strategy.engine_link`)."""

from lightrft.strategy.engine_link import is_engine
from lightrft.strategy.registry import get_strategy

__all__ = ["get_strategy", "is_engine"]
