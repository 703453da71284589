"""Upstream LightRFT's path ``lightrft.strategy.strategy`` (compatibility only; the
names live in :mod:`lightrft.strategy.registry` and :mod:`lightrft.strategy.rollout`)."""

from lightrft.strategy.registry import get_strategy
from lightrft.strategy.rollout import is_engine

__all__ = ["get_strategy", "is_engine"]
