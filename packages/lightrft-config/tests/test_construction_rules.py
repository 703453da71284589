"""Rules that need no world size fail when the config is built (or assigned), not only
when a strategy is set up; DeepSpeed's rules only when DeepSpeed is the backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import lightrft.config.strategy_config as strategy_config
from lightrft.config import ConfigError, StrategyConfig

ADAM_OFFLOAD_AT_STAGE_0 = (
    "adam_offload=True: needs ZeRO stage 1, 2 or 3 with the DeepSpeed backend (zero_stage=0); "
    "accepted: adam_offload=False, or zero_stage >= 1"
)


@pytest.fixture
def plugin_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """A backend registered by a plugin (as lightrft-testing registers 'fake')."""
    names = ("deepspeed", "fsdp2", "plugin")
    monkeypatch.setattr(strategy_config, "known_backend_names", lambda: names)
    return "plugin"


@pytest.mark.parametrize("backend", [{}, {"backend": "deepspeed"}])
def test_adam_offload_at_stage_0_fails_at_construction(backend: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(adam_offload=True, zero_stage=0, **backend)
    # names the field, its value and the fix, in the text the strategy uses at setup
    assert str(info.value) == f"invalid StrategyConfig (1 problem):\n  - {ADAM_OFFLOAD_AT_STAGE_0}"


def test_adam_offload_at_stage_0_fails_from_every_source() -> None:
    with pytest.raises(ConfigError, match=r"adam_offload=True: needs ZeRO stage 1, 2 or 3"):
        StrategyConfig.from_args({"adam_offload": True, "zero_stage": 0})
    # the rule joins two fields; the problem stays structured, so it names the source too
    from_env = r"adam_offload=True \(from environment variable LIGHTRFT_ADAM_OFFLOAD\): needs"
    with pytest.raises(ConfigError, match=from_env):
        StrategyConfig.load(environ={"LIGHTRFT_ADAM_OFFLOAD": "1", "LIGHTRFT_ZERO_STAGE": "0"})


def test_adam_offload_at_stage_0_fails_on_assignment_and_keeps_the_old_value() -> None:
    config = StrategyConfig(adam_offload=True, zero_stage=2)
    with pytest.raises(ConfigError, match=r"adam_offload=True: needs ZeRO stage 1, 2 or 3"):
        config.zero_stage = 0
    assert config.zero_stage == 2
    config = StrategyConfig(zero_stage=0)
    with pytest.raises(ConfigError, match=r"adam_offload=True.*zero_stage >= 1"):
        config.adam_offload = True
    assert config.adam_offload is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"adam_offload": True, "zero_stage": 1},
        {"adam_offload": True, "zero_stage": 3},
        {"adam_offload": False, "zero_stage": 0},
        # the ZeRO rule concerns DeepSpeed only
        {"adam_offload": True, "zero_stage": 0, "backend": "fsdp2"},
        {"adam_offload": True, "zero_stage": 0, "fsdp": True},
    ],
)
def test_adam_offload_is_accepted_where_it_works(kwargs: dict[str, Any]) -> None:
    StrategyConfig(**kwargs)


def test_deepspeed_rules_skip_other_registered_backends(plugin_backend: str) -> None:
    StrategyConfig(adam_offload=True, zero_stage=0, backend=plugin_backend)
    StrategyConfig(deepspeed_config={"optimizer": {}}, zero_stage=1, backend=plugin_backend)


@pytest.mark.parametrize(
    ("overlay", "fields", "expected"),
    [
        (
            {"train_micro_batch_size_per_gpu": 8},
            {},
            "deepspeed_config={'train_micro_batch_size_per_gpu': 8}: "
            "train_micro_batch_size_per_gpu=8 contradicts the strategy's 1; set "
            "micro_train_batch_size instead; accepted: drop 'train_micro_batch_size_per_gpu' "
            "from the overlay, or set it to 1",
        ),
        (
            {"train_batch_size": 64},
            {"sp_size": 2},
            "deepspeed_config={'train_batch_size': 64}: train_batch_size=64 contradicts the "
            "strategy's 256; it follows train_batch_size=128 x sp_size=2 (DeepSpeed counts "
            "sequence-parallel ranks too); change those instead; accepted: drop "
            "'train_batch_size' from the overlay, or set it to 256",
        ),
        (
            {"gradient_clipping": 2.0},
            {"max_norm": 1.0},
            "deepspeed_config={'gradient_clipping': 2.0}: gradient_clipping=2.0 contradicts "
            "the strategy's 1.0; set max_norm instead (<= 0 disables clipping)",
        ),
        (
            {"gradient_clipping": 1.0},
            {"max_norm": -1.0},
            "gradient_clipping=1.0 contradicts the strategy's 0.0; set max_norm instead",
        ),
        (
            {"zero_optimization": {"stage": 3}},
            {"zero_stage": 1},
            "deepspeed_config={'zero_optimization.stage': 3}: zero_optimization.stage=3 "
            "contradicts the strategy's 1; set zero_stage instead",
        ),
        (
            {"bf16": {"enabled": True}},
            {"precision": "fp32"},
            "deepspeed_config={'bf16.enabled': True}: bf16.enabled=True contradicts the "
            "strategy's False; set precision instead",
        ),
        (
            {"fp16": {"enabled": False}},
            {"precision": "fp16"},
            "fp16.enabled=False contradicts the strategy's True; set precision instead",
        ),
        (
            {"optimizer": {"type": "Adam"}},
            {},
            "deepspeed_config={'optimizer': {'type': 'Adam'}}: sets a DeepSpeed 'optimizer' "
            "section; the strategy builds the optimizer (create_optimizer / create_scheduler, "
            "or pass your own to prepare); accepted: a config without 'optimizer'",
        ),
        (
            {"scheduler": {"type": "WarmupLR"}},
            {},
            "sets a DeepSpeed 'scheduler' section; the strategy builds the scheduler",
        ),
    ],
)
def test_overlay_that_contradicts_the_config_fails_at_construction(
    overlay: dict[str, Any], fields: dict[str, Any], expected: str
) -> None:
    for given in (overlay, json.dumps(overlay)):
        with pytest.raises(ConfigError) as info:
            StrategyConfig(deepspeed_config=given, **fields)
        assert str(info.value).startswith("invalid StrategyConfig (1 problem):")
        assert expected in str(info.value), str(info.value)


def test_every_overlay_contradiction_is_reported_at_once() -> None:
    overlay = {"optimizer": {}, "gradient_clipping": 3, "zero_optimization": {"stage": 0}}
    with pytest.raises(ConfigError) as info:
        StrategyConfig(adam_offload=True, zero_stage=1, deepspeed_config=overlay)
    message = str(info.value)
    assert message.startswith("invalid StrategyConfig (3 problems):")
    for fragment in ("'optimizer' section", "gradient_clipping=3", "zero_optimization.stage=0"):
        assert fragment in message


@pytest.mark.parametrize(
    ("overlay", "fields"),
    [
        # keys that agree, keys the strategy does not derive, odd shapes DeepSpeed judges
        (
            {
                "train_batch_size": 128,
                "train_micro_batch_size_per_gpu": 1,
                "gradient_clipping": 1,
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                "bf16": {"enabled": True},
                "fp16": {"enabled": False},
            },
            {},
        ),
        ({"train_batch_size": 64}, {"train_batch_size": 32, "sp_size": 2}),
        ({"gradient_clipping": 0}, {"max_norm": 0.0}),
        ({"zero_optimization": "auto", "comms_logger": {"enabled": True}}, {}),
        # accumulation needs the world size: checked when the strategy is set up
        ({"gradient_accumulation_steps": 7}, {}),
        # other backends ignore the overlay
        ({"optimizer": {"type": "Adam"}, "gradient_clipping": 9}, {"backend": "fsdp2"}),
    ],
)
def test_overlay_accepted_at_construction(overlay: dict[str, Any], fields: dict[str, Any]) -> None:
    StrategyConfig(deepspeed_config=overlay, **fields)


def test_overlay_file_is_left_to_setup(tmp_path: Path) -> None:
    # a path is read only when the strategy is set up (it may exist on the training
    # machine alone), so its content is not checked here
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    assert StrategyConfig(deepspeed_config=str(path)).deepspeed_config == str(path)
    assert StrategyConfig(deepspeed_config=str(tmp_path / "absent.json")).deepspeed_config


def test_overlay_contradiction_fails_on_assignment() -> None:
    config = StrategyConfig(max_norm=1.0, deepspeed_config={"gradient_clipping": 1.0})
    with pytest.raises(ConfigError, match=r"gradient_clipping=1.0 contradicts the strategy's 2.0"):
        config.max_norm = 2.0
    assert config.max_norm == 1.0


def test_refused_cross_field_assignment_keeps_the_old_state() -> None:
    config = StrategyConfig(precision="bf16")
    with pytest.raises(ConfigError, match=r"engine_sleep_level=2 needs enable_engine_sleep=True"):
        config.engine_sleep_level = 2
    with pytest.raises(ConfigError, match=r"precision='bf16' contradicts bf16=False"):
        config.bf16 = False
    assert (config.engine_sleep_level, config.bf16) == (None, True)
    assert config.model_fields_set == {"precision", "bf16"}
