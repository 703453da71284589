"""Where rollout engines run: engine_placement, engine_ranks, max_staleness."""

from __future__ import annotations

from typing import Any

import pytest

from lightrft.config import ConfigError, StrategyConfig


@pytest.mark.parametrize(
    ("kwargs", "field", "fragments"),
    [
        ({"engine_ranks": 2}, "engine_ranks", ["applies to engine_placement='separate'"]),
        ({"max_staleness": 1}, "max_staleness", ["needs engine_placement='separate'", "turns"]),
        (
            {"engine_placement": "separate", "enable_engine_sleep": True},
            "enable_engine_sleep",
            [
                "contradicts engine_placement='separate'",
                "set enable_engine_sleep=False",
                "pass --disable_engine_sleep",
            ],
        ),
        (
            {"engine_placement": "separate", "engine_ranks": 3, "engine_tp_size": 2},
            "engine_tp_size",
            ["does not divide engine_ranks=3", "a multiple of 2"],
        ),
        ({"engine_placement": "separate", "engine_ranks": 0}, "engine_ranks", ["> 0"]),
        ({"max_staleness": -1}, "max_staleness", [">= 0"]),
        ({"engine_placement": "apart"}, "engine_placement", ["'colocated'", "'separate'"]),
    ],
)
def test_bad_placements_name_the_field_the_value_and_the_fix(
    kwargs: dict[str, Any], field: str, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(**kwargs)
    assert field in [p.field for p in info.value.problems]
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_separate_placement_trains_on_the_ranks_before_the_engine_ranks() -> None:
    config = StrategyConfig(
        engine_placement="separate",
        max_staleness=1,
        train_batch_size=16,
        micro_train_batch_size=4,
    )
    assert config.engine_ranks is None and config.trainer_ranks(3) == 2  # None: one rank
    assert config.gradient_accumulation_steps(3) == 2  # 16 / (4 x 2 trainer ranks)
    wider = StrategyConfig(engine_placement="separate", engine_ranks=2, engine_tp_size=2)
    assert wider.trainer_ranks(6) == 4
    assert StrategyConfig().trainer_ranks(3) == 3  # colocated: every rank trains


@pytest.mark.parametrize(
    ("kwargs", "world", "fragments"),
    [
        ({}, 1, ["engine_ranks=1", "leaves no trainer rank in a job of 1 rank(s)"]),
        ({"engine_ranks": 2}, 2, ["leaves no trainer rank", "set engine_ranks to 1..1"]),
        # the sizes of training divide the trainer ranks, not the job
        ({"sp_size": 2}, 4, ["sp_size=2", "world size 3 (3 trainer ranks of 4)"]),
        (
            {"train_batch_size": 8, "micro_train_batch_size": 4},
            4,
            ["train_batch_size=8", "4 x 3 = 12", "world size 3"],
        ),
    ],
)
def test_separate_placement_checks_the_job_size(
    kwargs: dict[str, Any], world: int, fragments: list[str]
) -> None:
    config = StrategyConfig(engine_placement="separate", **kwargs)
    with pytest.raises(ConfigError) as info:
        config.validate_world_size(world)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_separate_placement_fits_a_batch_to_the_trainer_ranks() -> None:
    config = StrategyConfig(engine_placement="separate", train_batch_size=8,
                            micro_train_batch_size=4)  # fmt: skip
    config.validate_world_size(3)  # 8 = 4 x 2 trainer ranks (a colocated job of 3 would not)
    with pytest.raises(ConfigError):
        StrategyConfig(train_batch_size=8, micro_train_batch_size=4).validate_world_size(3)
