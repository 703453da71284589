"""Summary text, rank-0 logging and the JSON Schema."""

from __future__ import annotations

import json
import logging

import pytest

from lightrft.config import StrategyConfig


def test_summary_names_only_changed_values_with_their_defaults() -> None:
    text = StrategyConfig(zero_stage=3, seed=7, extra_args={"team": "rl"}).summary()
    assert "zero_stage = 3  (default 2)" in text
    assert "seed" in text
    assert "bf16" not in text
    assert "team = 'rl'" in text
    assert "backend deepspeed" in text


def test_summary_of_defaults_says_so() -> None:
    assert "all fields at their defaults" in StrategyConfig().summary()


def test_log_summary_logs_once_on_rank_zero(caplog: pytest.LogCaptureFixture) -> None:
    config = StrategyConfig(seed=5)
    with caplog.at_level(logging.INFO, logger="lightrft.config"):
        assert config.log_summary(rank=0) is True
        assert config.log_summary(rank=0) is False
    assert len(caplog.records) == 1
    assert "seed = 5" in caplog.records[0].getMessage()


def test_log_summary_is_silent_off_rank_zero(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    config = StrategyConfig(seed=5)
    with caplog.at_level(logging.INFO, logger="lightrft.config"):
        assert config.log_summary() is False
        assert config.log_summary(rank=3) is False
    assert caplog.records == []
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.INFO, logger="lightrft.config"):
        assert config.log_summary() is True


def test_log_summary_to_a_given_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer"):
        StrategyConfig().log_summary(rank=0, log=logging.getLogger("trainer"))
    assert [r.name for r in caplog.records] == ["trainer"]


def test_json_schema_documents_every_field_with_bounds() -> None:
    schema = StrategyConfig.json_schema()
    json.dumps(schema)  # serialisable as is
    props = schema["properties"]
    assert set(props) == set(StrategyConfig.model_fields)
    assert all(p.get("description") for p in props.values())
    assert props["zero_stage"]["minimum"] == 0
    assert props["zero_stage"]["maximum"] == 3
    # open to registered engines: the built-ins are named, not enumerated
    assert props["engine_type"]["type"] == "string" and props["engine_type"]["default"] == "vllm"
    assert "'vllm', 'sglang', 'hf'" in props["engine_type"]["accepted"]
    assert props["zero_stage"]["default"] == 2


def test_config_round_trips_through_json() -> None:
    config = StrategyConfig(zero_stage=3, adam_betas=(0.8, 0.9), extra_args={"a": [1, 2]})
    assert StrategyConfig.model_validate_json(config.model_dump_json()) == config
