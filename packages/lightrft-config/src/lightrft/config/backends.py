"""Names of training backends and inference engines, known without importing any of them.

The strategy and engines packages map these names to classes; this module only knows
the names, so a configuration can be validated on a machine with no torch.
"""

from __future__ import annotations

#: The entry-point group third-party backends register under.
ENTRY_POINT_GROUP = "lightrft.strategies"

#: Backends that ship with lightrft-strategy: the one list of built-in names (the
#: strategy registry maps exactly these to classes). Every other backend, lightrft-testing's
#: ``fake`` included, registers under :data:`ENTRY_POINT_GROUP`.
BUILTIN_BACKENDS: tuple[str, ...] = ("deepspeed", "fsdp2")

#: Other spellings accepted for a built-in backend.
BACKEND_ALIASES: dict[str, str] = {"fsdp": "fsdp2", "ds": "deepspeed"}


def registered_backend_names() -> tuple[str, ...]:
    """Names registered by installed distributions under :data:`ENTRY_POINT_GROUP`."""
    from importlib.metadata import entry_points  # slow to import; needed only here

    return tuple(sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}))


def known_backend_names() -> tuple[str, ...]:
    """Every backend name a configuration may select: built-ins, then registered ones."""
    registered = [n for n in registered_backend_names() if n not in BUILTIN_BACKENDS]
    return (*BUILTIN_BACKENDS, *registered)


def canonical_backend_name(name: str) -> str:
    """``name`` with aliases resolved and case folded (``"FSDP"`` -> ``"fsdp2"``)."""
    folded = name.strip().lower()
    return BACKEND_ALIASES.get(folded, folded)


#: The entry-point group third-party inference engines register under.
ENGINE_ENTRY_POINT_GROUP = "lightrft.engines"

#: Engines that ship with lightrft-engines (``fake`` comes with lightrft-testing, by entry
#: point).
BUILTIN_ENGINES: tuple[str, ...] = ("vllm", "sglang", "hf")


def known_engine_names() -> tuple[str, ...]:
    """Every ``engine_type`` a configuration may select: built-ins, then the names
    registered under :data:`ENGINE_ENTRY_POINT_GROUP`."""
    from importlib.metadata import entry_points

    registered = sorted({ep.name for ep in entry_points(group=ENGINE_ENTRY_POINT_GROUP)})
    return (*BUILTIN_ENGINES, *(n for n in registered if n not in BUILTIN_ENGINES))
