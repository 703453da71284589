"""The rules a DeepSpeed setup must keep, written once.

:class:`~lightrft.config.StrategyConfig` applies them when it is built (with what is
known without a world size: an inline ``deepspeed_config`` mapping, the configured
``train_batch_size``); ``lightrft.strategy.deepspeed.ds_config`` applies them again at
setup, with the world size and an overlay read from its JSON file. Both report the
same :class:`~lightrft.config.ConfigProblem` texts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightrft.config.errors import ConfigProblem

if TYPE_CHECKING:
    from lightrft.config.strategy_config import StrategyConfig

#: Overlay sections the strategy owns (it builds the optimizer and the schedule).
OWNED_SECTIONS = ("optimizer", "scheduler")

_MISSING = object()


def adam_offload_problem(adam_offload: bool, zero_stage: int) -> ConfigProblem | None:
    """``adam_offload`` needs a ZeRO stage that partitions optimizer state."""
    if adam_offload and zero_stage == 0:
        return ConfigProblem(
            "adam_offload",
            True,
            "needs ZeRO stage 1, 2 or 3 with the DeepSpeed backend (zero_stage=0)",
            "adam_offload=False, or zero_stage >= 1",
        )
    return None


def derived_keys(config: StrategyConfig) -> dict[str, tuple[Any, str]]:
    """The overlay keys the strategy derives from ``config`` with no world size, each
    with its value and the field to change instead. The batch keys that need the world
    size are added by the caller."""
    precision = config.resolved_precision
    return {
        "train_micro_batch_size_per_gpu": (
            config.micro_train_batch_size,
            "set micro_train_batch_size instead",
        ),
        "gradient_clipping": (
            config.max_norm if config.max_norm > 0 else 0.0,
            "set max_norm instead (<= 0 disables clipping)",
        ),
        "zero_optimization.stage": (config.zero_stage, "set zero_stage instead"),
        "bf16.enabled": (precision == "bf16", "set precision instead"),
        "fp16.enabled": (precision == "fp16", "set precision instead"),
    }


def dotted_get(tree: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"``; ``default`` when a part is missing."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def overlay_problems(
    overlay: dict[str, Any], derived: dict[str, tuple[Any, str]]
) -> list[ConfigProblem]:
    """What is wrong with a ``deepspeed_config`` overlay: a section the strategy owns,
    or a derived key (``derived``: key -> (value, fix)) set to another value."""
    problems = [
        ConfigProblem(
            "deepspeed_config",
            {section: overlay[section]},
            f"sets a DeepSpeed {section!r} section; the strategy builds the {section} "
            "(create_optimizer / create_scheduler, or pass your own to prepare)",
            f"a config without {section!r}",
        )
        for section in OWNED_SECTIONS
        if section in overlay
    ]
    for key, (expected, fix) in derived.items():
        given = dotted_get(overlay, key)
        if given is _MISSING or given == expected:
            continue
        problems.append(
            ConfigProblem(
                "deepspeed_config",
                {key: given},
                f"{key}={given!r} contradicts the strategy's {expected!r}; {fix}",
                f"drop {key!r} from the overlay, or set it to {expected!r}",
            )
        )
    return problems
