"""A readable account of a configuration: what differs from the defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightrft.config.strategy_config import StrategyConfig


def changed_fields(config: StrategyConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (value, default)}`` for every field whose value is not the default."""
    changed: dict[str, tuple[Any, Any]] = {}
    for name, info in type(config).model_fields.items():
        if name == "extra_args":
            continue
        value = getattr(config, name)
        default = info.get_default(call_default_factory=True)
        if value != default:
            changed[name] = (value, default)
    return changed


def render(config: StrategyConfig) -> str:
    """Multi-line text: the backend, then changed fields, then extra arguments."""
    lines = [f"{type(config).__name__} (backend {config.resolved_backend}, device {config.device})"]
    changed = changed_fields(config)
    if changed:
        width = max(len(name) for name in changed)
        lines.append("  changed from defaults:")
        lines += [
            f"    {name:<{width}} = {value!r}  (default {default!r})"
            for name, (value, default) in changed.items()
        ]
    else:
        lines.append("  all fields at their defaults")
    if config.extra_args:
        lines.append(f"  extra_args ({len(config.extra_args)}):")
        lines += [f"    {k} = {v!r}" for k, v in sorted(config.extra_args.items())]
    return "\n".join(lines)
