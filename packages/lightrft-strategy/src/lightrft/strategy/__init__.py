"""One training-strategy interface over DeepSpeed and PyTorch FSDP2, on CUDA or CPU.

    from lightrft.strategy import get_strategy
    strategy = get_strategy(args)          # argparse namespace, dict or StrategyConfig
    # ready: joined the launched job (or a world of one), device picked, seeded

Backends are imported only when selected: importing this package imports neither
DeepSpeed nor any inference engine.
"""

from __future__ import annotations

from typing import Any

from lightrft.config import ConfigError, StrategyConfig
from lightrft.strategy.base import StrategyBase
from lightrft.strategy.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    ForeignCheckpointError,
    IncompleteCheckpointError,
)
from lightrft.strategy.construction import NotSetUpError
from lightrft.strategy.registry import (
    UnknownBackendError,
    available_backends,
    get_backend,
    get_strategy,
    register_backend,
)
from lightrft.strategy.rollout import is_engine


def get_fake_strategy(
    args: Any = None, *, defer_setup: bool = False, **overrides: Any
) -> StrategyBase:
    """A ready single-process ``FakeStrategy`` for tests: the backend registered as
    ``fake`` (by lightrft-testing, through the ``lightrft.strategies`` entry points)."""
    try:
        cls = get_backend("fake")
    except UnknownBackendError as exc:
        raise ImportError(
            "get_fake_strategy needs the 'fake' backend, which the lightrft-testing "
            "distribution registers: pip install lightrft-testing"
        ) from exc
    return cls(args=args, defer_setup=defer_setup, **overrides)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("lightrft-strategy")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ForeignCheckpointError",
    "IncompleteCheckpointError",
    "NotSetUpError",
    "StrategyBase",
    "StrategyConfig",
    "UnknownBackendError",
    "__version__",
    "available_backends",
    "get_backend",
    "get_fake_strategy",
    "get_strategy",
    "is_engine",
    "register_backend",
]
