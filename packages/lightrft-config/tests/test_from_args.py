"""StrategyConfig.from_args and get_extra_arg."""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest

from lightrft.config import ConfigError, StrategyConfig

from .test_fields import UPSTREAM_DEFAULTS


def upstream_namespace(**changes: object) -> argparse.Namespace:
    """A namespace like an upstream LightRFT trainer's: every field plus trainer args."""
    values: dict[str, object] = {k: v for k, v in UPSTREAM_DEFAULTS.items() if k != "extra_args"}
    values.update(pretrain="Qwen/Qwen2-0.5B", save_path="./ckpt", num_episodes=1)
    values.update(changes)
    return argparse.Namespace(**values)


def test_upstream_namespace_converts_unchanged() -> None:
    config = StrategyConfig.from_args(upstream_namespace(zero_stage=3, adam_betas=[0.9, 0.99]))
    assert config.zero_stage == 3
    assert config.adam_betas == (0.9, 0.99)
    assert config.extra_args == {
        "pretrain": "Qwen/Qwen2-0.5B",
        "save_path": "./ckpt",
        "num_episodes": 1,
    }


@dataclasses.dataclass(slots=True)
class SlotsArgs:
    seed: int = 5
    learning_rate_schedule: str = "cosine"


class PlainArgs:
    def __init__(self) -> None:
        self.seed = 6
        self.team = "rl"
        self._private = "hidden"


@pytest.mark.parametrize(
    ("source", "seed", "extra"),
    [
        (argparse.Namespace(seed=1, team="rl"), 1, {"team": "rl"}),
        ({"seed": 2, "team": "rl"}, 2, {"team": "rl"}),
        (types.MappingProxyType({"seed": 3}), 3, {}),
        (SlotsArgs(), 5, {"learning_rate_schedule": "cosine"}),
        (PlainArgs(), 6, {"team": "rl"}),
        (StrategyConfig(seed=7, extra_args={"team": "rl"}), 7, {"team": "rl"}),
    ],
    ids=["namespace", "dict", "mapping", "slots-dataclass", "object", "config"],
)
def test_from_args_accepts_many_sources(
    source: object, seed: int, extra: dict[str, object]
) -> None:
    config = StrategyConfig.from_args(source)
    assert config.seed == seed
    assert config.extra_args == extra


def test_from_args_of_a_config_is_an_equal_copy() -> None:
    original = StrategyConfig(seed=9, zero_stage=1, extra_args={"a": [1]})
    copy = StrategyConfig.from_args(original)
    assert copy == original
    assert copy is not original


def test_overrides_win() -> None:
    config = StrategyConfig.from_args({"seed": 1, "zero_stage": 1}, seed=2)
    assert (config.seed, config.zero_stage) == (2, 1)


def test_strings_are_converted() -> None:
    config = StrategyConfig.from_args({"zero_stage": "3", "bf16": "false", "l2": "0.1"})
    assert (config.zero_stage, config.bf16, config.l2) == (3, False, 0.1)


def test_none_means_not_given_for_fields_that_cannot_be_null() -> None:
    config = StrategyConfig.from_args(
        {"seed": None, "critic_pretrain": None, "pretrain_data": None}
    )
    assert config.seed == 42
    assert config.critic_pretrain is False
    assert config.pretrain_data is None


def test_unknown_names_land_in_extra_args_and_merge_with_given_extra_args() -> None:
    config = StrategyConfig.from_args({"extra_args": {"a": 1}, "b": 2})
    assert config.extra_args == {"a": 1, "b": 2}


def test_get_extra_arg() -> None:
    config = StrategyConfig.from_args({"rollout_temperature": 0.7, "zero_stage": 3})
    assert config.get_extra_arg("rollout_temperature") == 0.7
    assert config.get_extra_arg("missing") is None
    assert config.get_extra_arg("missing", "dflt") == "dflt"
    # A name the config models answers with the field's value.
    assert config.get_extra_arg("zero_stage") == 3


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("zero_stag", "zero_stage"),
        ("sed", "seed"),
        ("bf61", "bf16"),
        ("adam_bteas", "adam_betas"),
        ("zero_stg", None),
    ],
)
def test_one_edit_typo_warns(
    caplog: pytest.LogCaptureFixture, typo: str, meant: str | None
) -> None:
    with caplog.at_level("WARNING", logger="lightrft.config"):
        config = StrategyConfig.from_args({typo: 1})
    assert config.extra_args == {typo: 1}
    if meant is None:  # two edits away: no guess
        assert caplog.records == []
    else:
        (record,) = caplog.records
        assert f"{typo!r}" in record.getMessage()
        assert f"did you mean {meant!r}" in record.getMessage()


def test_far_names_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="lightrft.config"):
        StrategyConfig.from_args(upstream_namespace())
    assert caplog.records == []


def test_from_args_rejects_what_is_not_a_namespace() -> None:
    with pytest.raises(TypeError, match=r"from_args expects an argparse.Namespace.*got int: 3"):
        StrategyConfig.from_args(3)


def test_invalid_known_value_is_an_error_even_leniently() -> None:
    with pytest.raises(ConfigError, match=r"zero_stage=4"):
        StrategyConfig.from_args(upstream_namespace(zero_stage=4))
