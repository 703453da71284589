"""One training-strategy interface over DeepSpeed and PyTorch FSDP2, on CUDA or CPU.

    from lightrft.strategy import get_strategy
    strategy = get_strategy(args)          # argparse namespace, dict or StrategyConfig
    # ready: joined the launched job (or a world of one), device picked, seeded

Backends are imported only when selected: importing this package imports neither
DeepSpeed nor any inference engine, and its public names (and torch) load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below are imported on first use (see __getattr__)
    from lightrft.config import ConfigError, StrategyConfig
    from lightrft.strategy.base import StrategyBase
    from lightrft.strategy.checkpoint import (
        CheckpointError,
        CheckpointNotFoundError,
        ForeignCheckpointError,
        IncompleteCheckpointError,
    )
    from lightrft.strategy.construction import NotSetUpError
    from lightrft.strategy.engine_link import is_engine
    from lightrft.strategy.micro_batches import PlanError, StepPlan
    from lightrft.strategy.registry import (
        UnknownBackendError,
        available_backends,
        get_backend,
        get_strategy,
        register_backend,
    )
    from lightrft.strategy.roll_call import CollectiveError

# Public name -> the module that defines it. Imported lazily, so that importing a
# submodule that needs no torch (the ``lightrft`` command's parser) stays fast.
_LAZY = {
    "ConfigError": "lightrft.config",
    "StrategyConfig": "lightrft.config",
    "StrategyBase": "lightrft.strategy.base",
    "CheckpointError": "lightrft.strategy.checkpoint",
    "CheckpointNotFoundError": "lightrft.strategy.checkpoint",
    "ForeignCheckpointError": "lightrft.strategy.checkpoint",
    "IncompleteCheckpointError": "lightrft.strategy.checkpoint",
    "NotSetUpError": "lightrft.strategy.construction",
    "CollectiveError": "lightrft.strategy.roll_call",
    "PlanError": "lightrft.strategy.micro_batches",
    "StepPlan": "lightrft.strategy.micro_batches",
    "UnknownBackendError": "lightrft.strategy.registry",
    "available_backends": "lightrft.strategy.registry",
    "get_backend": "lightrft.strategy.registry",
    "get_strategy": "lightrft.strategy.registry",
    "register_backend": "lightrft.strategy.registry",
    "is_engine": "lightrft.strategy.engine_link",
}


def _fake_backend() -> type[StrategyBase]:
    """``FakeStrategy``: the backend registered as ``fake`` (by lightrft-testing, through
    the ``lightrft.strategies`` entry points)."""
    from lightrft.strategy.registry import UnknownBackendError, get_backend

    try:
        return get_backend("fake")
    except UnknownBackendError as exc:
        raise ImportError(
            "FakeStrategy and get_fake_strategy need the 'fake' backend, which the "
            "lightrft-testing distribution registers: pip install lightrft-testing"
        ) from exc


def get_fake_strategy(
    args: Any = None, *, defer_setup: bool = False, **overrides: Any
) -> StrategyBase:
    """A ready single-process ``FakeStrategy`` for tests (see :func:`_fake_backend`)."""
    return _fake_backend()(args=args, defer_setup=defer_setup, **overrides)


def __getattr__(name: str) -> Any:
    if name == "FakeStrategy":  # upstream's import; the fake ships in lightrft-testing
        return _fake_backend()
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib.metadata import version

        return version("lightrft-strategy")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CollectiveError",
    "ConfigError",
    "FakeStrategy",
    "ForeignCheckpointError",
    "IncompleteCheckpointError",
    "NotSetUpError",
    "PlanError",
    "StepPlan",
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
