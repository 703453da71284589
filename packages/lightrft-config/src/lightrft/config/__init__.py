"""Typed configuration for LightRFT training strategies.

``import lightrft.config`` needs pydantic only: no torch, no device queries.
"""

from importlib.metadata import version as _version

from lightrft.config.backends import BUILTIN_BACKENDS, ENTRY_POINT_GROUP, known_backend_names
from lightrft.config.errors import ConfigError, ConfigProblem
from lightrft.config.strategy_config import StrategyConfig

__version__ = _version("lightrft-config")

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "ConfigError",
    "ConfigProblem",
    "StrategyConfig",
    "__version__",
    "known_backend_names",
]
