"""Checks that need the world size: the one method the strategy calls."""

from __future__ import annotations

import pytest

from lightrft.config import ConfigError, StrategyConfig


@pytest.mark.parametrize(
    ("kwargs", "world", "steps"),
    [
        ({"train_batch_size": 128, "micro_train_batch_size": 1}, 8, 16),
        ({"train_batch_size": 32, "micro_train_batch_size": 4}, 2, 4),
        ({"train_batch_size": 32, "micro_train_batch_size": 4, "sp_size": 2}, 4, 4),
        ({"train_batch_size": 8, "micro_train_batch_size": 8}, 1, 1),
    ],
)
def test_gradient_accumulation_steps(kwargs: dict[str, int], world: int, steps: int) -> None:
    assert StrategyConfig(**kwargs).gradient_accumulation_steps(world) == steps


@pytest.mark.parametrize(
    ("kwargs", "world", "fragments"),
    [
        (
            {"train_batch_size": 12, "micro_train_batch_size": 4},
            2,
            ["train_batch_size=12", "4 x 2 = 8", "world size 2", "a multiple of 8, e.g. 8 or 16"],
        ),
        ({"sp_size": 3}, 8, ["sp_size=3", "does not divide the world size 8", "1, 2, 4, 8"]),
        ({"engine_tp_size": 4}, 6, ["engine_tp_size=4", "world size 6", "1, 2, 3, 6"]),
        ({"zpg": 4}, 2, ["zpg=4", "world size 2"]),
        ({"backend": "fsdp2", "fsdp_shard_size": 3}, 4, ["fsdp_shard_size=3", "1, 2, 4"]),
    ],
)
def test_world_size_mismatch_gives_the_numbers(
    kwargs: dict[str, int], world: int, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(**kwargs).validate_world_size(world)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_zpg_only_matters_to_deepspeed() -> None:
    StrategyConfig(zpg=4, backend="fsdp2").validate_world_size(2)


def test_every_mismatch_is_reported() -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(sp_size=3, engine_tp_size=5).validate_world_size(4)
    assert [p.field for p in info.value.problems] == ["sp_size", "engine_tp_size"]


@pytest.mark.parametrize("world", [0, -2, 1.5, True, "2"])
def test_world_size_itself_must_be_a_positive_integer(world: object) -> None:
    with pytest.raises(ConfigError, match=r"world_size=.*must be a positive integer"):
        StrategyConfig().validate_world_size(world)  # type: ignore[arg-type]
