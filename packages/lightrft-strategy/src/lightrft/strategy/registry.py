"""Backend registry and the `get_strategy` factory.

Built-in backends are named here and imported only when selected; third-party ones
register under the ``lightrft.strategies`` entry-point group (``name =
"package.module:StrategyClass"``) or at run time with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from lightrft.config import ENTRY_POINT_GROUP, StrategyConfig
from lightrft.config.backends import BUILTIN_BACKENDS, canonical_backend_name

if TYPE_CHECKING:
    from lightrft.strategy.base import StrategyBase

logger = logging.getLogger(__name__)

#: Where each of lightrft-config's ``BUILTIN_BACKENDS`` lives:
#: name -> ("module:Class", the distribution/extra that provides it).
BUILTIN: dict[str, tuple[str, str]] = {
    "fsdp2": ("lightrft.strategy.fsdp2:FSDP2Strategy", "lightrft-strategy"),
    "deepspeed": (
        "lightrft.strategy.deepspeed.strategy:DeepspeedStrategy",
        "lightrft-strategy[deepspeed]",
    ),
}
if set(BUILTIN) != set(BUILTIN_BACKENDS):  # pragma: no cover - a packaging mistake
    raise ImportError(
        f"lightrft-strategy maps backends {sorted(BUILTIN)} but lightrft-config names "
        f"{sorted(BUILTIN_BACKENDS)} as built in; install matching versions of both"
    )
_registered: dict[str, Any] = {}


class UnknownBackendError(KeyError):
    """No backend of that name; the message lists the valid ones."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_backend(name: str, strategy: type[StrategyBase] | str) -> None:
    """Register ``strategy`` (a class, or ``"module:Class"``) under ``name`` for this run."""
    _registered[canonical_backend_name(name)] = strategy


def available_backends() -> list[str]:
    """Every name :func:`get_strategy` accepts: built-ins, entry points, registered."""
    from importlib.metadata import entry_points

    names = set(BUILTIN) | set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def _load(target: str, provider: str | None, name: str) -> type[StrategyBase]:
    """Import ``"module:Class"``. ``provider`` is the distribution (or extra) that ships
    it, None for a name given to :func:`register_backend` at run time."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if provider is None:
            raise ImportError(
                f"backend {name!r} was registered as {target!r}, but module {exc.name!r} "
                "cannot be imported; install the distribution that provides it, or register "
                "the backend under an importable path"
            ) from exc
        raise ImportError(
            f"backend {name!r} needs {provider} (missing module {exc.name!r}); "
            f"install it with: pip install '{provider}'"
        ) from exc
    try:
        cls: type[StrategyBase] = getattr(module, attr)
    except AttributeError:
        fix = f"upgrade {provider}" if provider else "fix the registration"
        raise ImportError(f"backend {name!r}: {module_name} has no {attr}; {fix}") from None
    return cls


def get_backend(name: str) -> type[StrategyBase]:
    """The strategy class registered as ``name`` (aliases like ``fsdp`` accepted)."""
    from importlib.metadata import entry_points

    key = canonical_backend_name(name)
    if key in _registered:
        found = _registered[key]
        return _load(found, None, key) if isinstance(found, str) else found
    if key in BUILTIN:
        return _load(*BUILTIN[key], key)
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=key):
        return _load(ep.value, ep.dist.name if ep.dist else ep.value, key)
    raise UnknownBackendError(
        f"unknown strategy backend {name!r}; available: {', '.join(available_backends())}. "
        f"Third-party backends register under the {ENTRY_POINT_GROUP!r} entry-point group."
    )


def get_strategy(args: Any = None, *, defer_setup: bool = False, **overrides: Any) -> StrategyBase:
    """Build the configured strategy from a StrategyConfig, an argparse namespace or a
    mapping. The backend is ``backend`` when set, else FSDP2 when ``fsdp`` is true and
    DeepSpeed otherwise (upstream's rule).

    The strategy returned has joined the job, as upstream's ``get_strategy`` (whose
    ``StrategyBase.__init__`` calls ``setup_distributed()``): process group, device,
    world-size checks and seed are done, ``world_size`` and ``accumulated_gradient``
    are known. ``defer_setup=True`` leaves :meth:`~StrategyBase.setup_distributed` to
    the caller; until it runs, calls that depend on the world raise ``NotSetUpError``.
    ``args`` may be passed by keyword (``get_strategy(args=namespace)``), as upstream.
    """
    if isinstance(args, StrategyConfig) and not overrides:
        config = args
    else:
        config = StrategyConfig.from_args(args, **overrides)
    cls = get_backend(config.resolved_backend)
    strategy = cls(config, defer_setup=True) if defer_setup else cls(config)
    strategy.args = args if args is not None else config
    return strategy
