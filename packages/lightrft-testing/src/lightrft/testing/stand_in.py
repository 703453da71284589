"""Stand-ins for classes that cannot run here, with the real classes' signatures.

A hand-written mock agrees with whatever the adapter under test calls; a stand-in made
by :func:`stand_in` does not: each of its methods carries the signature of the installed
class's method of the same name (``inspect.signature``), binds every call to it (a
wrong or missing argument raises ``TypeError`` exactly where the real call would),
records the arguments as passed, and only then runs the behaviour the test supplies
(with the real defaults filled in). Used
for SGLang, which imports on CPU but cannot serve there::

    from sglang.srt.entrypoints.engine import Engine

    FakeSGLang = stand_in(Engine, behaviour, methods=["generate", "flush_cache"])
    engine = FakeSGLang(model_path="m")  # binds to Engine.__init__
    engine.generate(input_ids=[[1, 2]])  # binds to Engine.generate, runs behaviour.generate
    engine.calls  # [("__init__", {...}), ("generate", {...})]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any


def _binder(name: str, signature: inspect.Signature, behaviour: Any) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        self.calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))
        target = getattr(behaviour, "construct" if name == "__init__" else name, None)
        if target is None:
            return None
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        return target(self, **_flatten(signature, arguments))

    method.__name__ = name
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


def _flatten(signature: inspect.Signature, arguments: dict[str, Any]) -> dict[str, Any]:
    """Bound arguments as keywords (``**kwargs`` parameters spread out)."""
    out: dict[str, Any] = {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(value)
        else:
            out[name] = value
    return out


def stand_in(real: type, behaviour: Any, *, methods: Iterable[str]) -> type:
    """A class with ``real``'s constructor and ``methods``, each with the real signature.

    Args:
        real: the installed class whose signatures the stand-in takes.
        behaviour: an object whose methods of the same names run after a call binds,
            as ``behaviour.name(stand_in_instance, **arguments)`` (``construct`` for the
            constructor; ``**kwargs`` parameters arrive spread out); a name it lacks
            returns None.
        methods: the method names to copy from ``real`` (every one must exist there).

    Returns:
        A class; each instance has ``calls``, the list of ``(method, arguments)`` in
        call order, ``"__init__"`` first.

    Raises:
        AttributeError: ``real`` has no method of one of the names.
    """
    namespace: dict[str, Any] = {"__doc__": f"Stand-in for {real.__qualname__}."}
    for name in ["__init__", *methods]:
        function = inspect.getattr_static(real, name)
        if isinstance(function, staticmethod | classmethod):
            raise TypeError(f"{real.__qualname__}.{name} is not an instance method")
        signature = inspect.signature(function)
        namespace[name] = _binder(name, signature, behaviour)
    original_init = namespace["__init__"]

    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        self.calls = []
        original_init(self, *args, **kwargs)

    real_init = inspect.getattr_static(real, "__init__")
    construct.__signature__ = inspect.signature(real_init)  # type: ignore[attr-defined]
    namespace["__init__"] = construct
    return type(f"StandIn{real.__name__}", (), namespace)
