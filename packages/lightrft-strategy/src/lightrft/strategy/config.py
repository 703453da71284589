"""Compatibility path: ``from lightrft.strategy.config import StrategyConfig``."""

from lightrft.config import ConfigError, StrategyConfig

__all__ = ["ConfigError", "StrategyConfig"]
