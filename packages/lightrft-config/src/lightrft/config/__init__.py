"""Typed configuration for LightRFT training strategies.

``import lightrft.config`` needs pydantic only: no torch, no device queries.
"""

from typing import Any

from lightrft.config.backends import BUILTIN_BACKENDS, ENTRY_POINT_GROUP, known_backend_names
from lightrft.config.errors import ConfigError, ConfigProblem
from lightrft.config.strategy_config import StrategyConfig


def __getattr__(name: str) -> Any:
    # importlib.metadata costs ~60 ms to import; only pay it when asked.
    if name == "__version__":
        from importlib.metadata import version

        return version("lightrft-config")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "ConfigError",
    "ConfigProblem",
    "StrategyConfig",
    "__version__",
    "known_backend_names",
]
