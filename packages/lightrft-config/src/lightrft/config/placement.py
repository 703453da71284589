"""The rules of where rollout engines run (``engine_placement``, ``engine_ranks``,
``max_staleness``): those known from the config alone, and those of a job's size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightrft.config.errors import ConfigProblem

if TYPE_CHECKING:
    from lightrft.config.strategy_config import StrategyConfig


def placement_problems(config: StrategyConfig) -> list[ConfigProblem]:
    """Combinations that cannot work at any world size."""
    problems = []
    if config.engine_placement == "colocated":
        if config.engine_ranks is not None:
            problems.append(
                ConfigProblem(
                    "engine_ranks",
                    config.engine_ranks,
                    "applies to engine_placement='separate' only (colocated engines serve "
                    "on every rank)",
                    fix="set engine_placement=separate, or leave engine_ranks unset",
                )
            )
        if config.max_staleness:
            problems.append(
                ConfigProblem(
                    "max_staleness",
                    config.max_staleness,
                    "needs engine_placement='separate': colocated engines and trainers take "
                    "turns on the same ranks, so every rollout uses the newest weights",
                    fix="set engine_placement=separate, or max_staleness=0",
                )
            )
        return problems
    if config.enable_engine_sleep:
        problems.append(
            ConfigProblem(
                "enable_engine_sleep",
                True,
                "contradicts engine_placement='separate': engines on their own ranks keep "
                "their memory (sleep frees a colocated engine's memory for the trainer)",
                fix="set enable_engine_sleep=False (upstream's train_colocate.py enables "
                "it by default: pass --disable_engine_sleep), or engine_placement=colocated",
            )
        )
    engines = config.engine_ranks or 1
    if engines % config.engine_tp_size:
        problems.append(
            ConfigProblem(
                "engine_tp_size",
                config.engine_tp_size,
                f"does not divide engine_ranks={engines} (each engine spans engine_tp_size "
                "of the engine ranks)",
                fix=f"set engine_ranks to a multiple of {config.engine_tp_size}, or "
                "engine_tp_size to a divisor of engine_ranks",
            )
        )
    return problems


def engine_ranks_problems(config: StrategyConfig, world_size: int) -> list[ConfigProblem]:
    """With separate placement, a job of ``world_size`` ranks must keep at least one
    trainer rank besides its ``engine_ranks``."""
    if config.engine_placement != "separate":
        return []
    engines = config.engine_ranks or 1
    if engines < world_size:
        return []
    return [
        ConfigProblem(
            "engine_ranks",
            engines,
            f"leaves no trainer rank in a job of {world_size} rank(s) "
            "(engine_placement='separate')",
            fix=(f"set engine_ranks to 1..{world_size - 1}, " if world_size > 1 else "")
            + f"launch more than {engines} rank(s), or use engine_placement=colocated",
        )
    ]
