"""``python -m lightrft.config show|validate|schema`` (lightrft-strategy's ``lightrft
config`` mounts the same group), in a new process and through click's CliRunner: each
value's source, every problem at once, the JSON Schema, flags passed through, exit
status 0 / 1 (invalid) / 2 (usage)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from lightrft.config import StrategyConfig
from lightrft.config.cli import config

FIELDS = [name for name in StrategyConfig.model_fields if name != "extra_args"]


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without LIGHTRFT_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LIGHTRFT_")}
    return {**env, **(extra or {})}


def run(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a new process: ``python -m lightrft.config``."""
    head = [sys.executable, "-m", "lightrft.config"]
    return subprocess.run(
        [*head, *args], capture_output=True, text=True, env=_clean_env(env), timeout=120
    )


def invoke(*args: str, env: Mapping[str, str] | None = None) -> Result:
    """The command in this process, through click's test runner."""
    unset: dict[str, str | None] = {
        k: None for k in os.environ if k.upper().startswith("LIGHTRFT_")
    }
    return CliRunner().invoke(
        config, list(args), env={**unset, **(env or {})}, catch_exceptions=False
    )


def table(stdout: str) -> dict[str, tuple[str, str]]:
    """``show``'s table: field -> (value, source)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["field", "value", "source"])
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("("):
            break
        name, value, source = re.split(r"\s{2,}", line, maxsplit=2)
        rows[name] = (value, source)
    return rows


@pytest.fixture
def layered(tmp_path: Path) -> tuple[Path, dict[str, str], list[str]]:
    """A YAML file, environment variables and flags that overlap: flags win over the
    environment, which wins over the file."""
    path = tmp_path / "train.yaml"
    path.write_text(
        "zero_stage: 3\nseed: 1\ntrain_batch_size: 64\nlr_scheduler: cosine\npretrain: /models/x\n"
    )
    env = {"LIGHTRFT_SEED": "7", "LIGHTRFT_TRAIN_BATCH_SIZE": "32"}
    flags = ["--train_batch_size", "16", "--micro-train-batch-size", "4", "--backend", "fsdp2"]
    return path, env, flags


# -- show --------------------------------------------------------------------------------
def test_show_names_the_source_of_each_value(
    layered: tuple[Path, dict[str, str], list[str]],
) -> None:
    path, env, flags = layered
    out = run("show", "--config", str(path), *flags, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == (
        "StrategyConfig: backend fsdp2, engine_type vllm, device auto, precision bf16"
    )
    rows = table(out.stdout)
    assert rows == {
        "seed": ("7", "environment variable LIGHTRFT_SEED"),
        "micro_train_batch_size": ("4", "command line --micro_train_batch_size"),
        "train_batch_size": ("16", "command line --train_batch_size"),
        "zero_stage": ("3", f"file {path}"),
        "fsdp": ("True", "derived from other fields"),  # backend='fsdp2' sets it
        "backend": ("'fsdp2'", "command line --backend"),
        "lr_scheduler": ("'cosine'", f"file {path}"),
        "extra_args.pretrain": ("'/models/x'", f"file {path}"),
    }
    hidden = len(FIELDS) - (len(rows) - 1)
    assert out.stdout.splitlines()[-1] == f"(the other {hidden} fields are at the default; " + (
        "--all lists them)"
    )


def test_show_reports_bad_values_without_a_traceback() -> None:
    out = run("show", "--zero_stage", "7")
    assert out.returncode == 1, out.stdout + out.stderr  # invalid: 1, as validate
    assert "zero_stage = 7 (from command line --zero_stage)" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_command_is_a_usage_error() -> None:
    out = run("frobnicate")
    assert out.returncode == 2
    assert "No such command 'frobnicate'" in out.stderr
    assert "python -m lightrft.config" in out.stderr


def test_show_all_lists_every_field_and_json_holds_values_and_sources(
    layered: tuple[Path, dict[str, str], list[str]],
) -> None:
    path, env, flags = layered
    every = invoke("show", "--all", "--config", str(path), *flags, env=env)
    assert every.exit_code == 0, every.output
    rows = table(every.stdout)
    assert [name for name in rows if not name.startswith("extra_args.")] == FIELDS
    assert rows["bf16"] == ("True", "default")

    result = invoke("show", "--json", "--config", str(path), *flags, env=env)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    assert data["valid"] is True
    assert data["resolved"] == {"backend": "fsdp2", "precision": "bf16", "sleep_level": None}
    assert list(data["fields"]) == FIELDS
    expected = StrategyConfig.load(
        file=path, environ=env, args={"train_batch_size": 16, "micro_train_batch_size": 4,
                                       "backend": "fsdp2"},
    ).model_dump(mode="json")  # fmt: skip
    assert {name: f["value"] for name, f in data["fields"].items()} == {
        name: expected[name] for name in FIELDS
    }
    sources = {name: f["source"] for name, f in data["fields"].items()}
    assert sources["seed"] == "environment variable LIGHTRFT_SEED"
    assert sources["train_batch_size"] == "command line --train_batch_size"
    assert sources["zero_stage"] == f"file {path}"
    assert sources["fsdp"] == "derived from other fields"
    assert sources["l2"] == "default"
    assert data["fields"]["seed"]["default"] == 42
    assert data["extra_args"] == {"pretrain": {"value": "/models/x", "source": f"file {path}"}}


def test_show_passes_dashed_negative_and_boolean_flags_through() -> None:
    result = invoke(
        "show", "--json", "--zero-stage", "1", "--max_norm", "-1",
        "--no-bf16", "--adam_betas", "0.8", "0.9", "--engine_max_model_len", "none",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)["fields"]
    assert fields["zero_stage"] == {"value": 1, "source": "command line --zero_stage", "default": 2}
    assert fields["max_norm"]["value"] == -1.0
    assert fields["bf16"]["value"] is False
    assert fields["adam_betas"]["value"] == [0.8, 0.9]
    assert fields["engine_max_model_len"]["source"] == "command line --engine_max_model_len"


def test_show_with_nothing_set_says_so() -> None:
    result = invoke("show")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "StrategyConfig: backend deepspeed, engine_type vllm, device auto, precision bf16",
        "(every field is at the default; --all lists them)",
    ]


# -- validate ----------------------------------------------------------------------------
def test_validate_reports_every_problem_with_field_value_source_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("device: gpu\nlr_warmup_ratio: 2\n")
    env = {"LIGHTRFT_ZERO_STAGE": "7"}
    flags = ["--seed", "-1", "--adam_betas", "0.9", "1.5", "--lr_scheduler", "cosin"]
    out = run("validate", "--config", str(path), *flags, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout == ""
    text = out.stderr
    assert text.startswith("error: invalid StrategyConfig (6 problems)\n")
    expected = {
        "seed": ("-1", "command line --seed", "set seed to an integer >= 0"),
        "zero_stage": ("7", "environment variable LIGHTRFT_ZERO_STAGE", "<= 3"),
        "adam_betas": ("0.9 1.5", "command line --adam_betas", "each >= 0 and < 1"),
        "lr_warmup_ratio": ("2", f"file {path}", "set lr_warmup_ratio to a number >= 0"),
        "device": ("'gpu'", f"file {path}", "set device to one of 'auto', 'cpu', 'cuda'"),
        "lr_scheduler": ("cosin", "command line --lr_scheduler", "'cosine'"),
    }
    for name, (value, source, fix) in expected.items():
        block = re.search(
            rf"\d+\. {name} = {re.escape(value)} \(from {re.escape(source)}\)\n"
            r"\s+problem: (?P<problem>.+)\n\s+fix: (?P<fix>.+)",
            text,
        )
        assert block is not None, f"{name} not reported as expected in:\n{text}"
        assert fix in block["fix"], block["fix"]
    assert "did you mean 'cosine'?" in text


def test_validate_json_lists_the_same_problems() -> None:
    result = invoke("validate", "--json", "--zero_stage", "9", "--device", "tpu",
                    "--micro_train_batch_size", "0")  # fmt: skip
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["valid"] is False
    by_field = {p["field"]: p for p in data["problems"]}
    assert set(by_field) == {"zero_stage", "device", "micro_train_batch_size"}
    assert by_field["zero_stage"] == {
        "field": "zero_stage",
        "value": "9",
        "source": "command line --zero_stage",
        "message": "input should be less than or equal to 3",
        "fix": "set zero_stage to an integer >= 0 and <= 3",
    }
    assert all(p["fix"] and p["source"] for p in data["problems"])


def test_validate_names_the_field_of_a_cross_field_problem() -> None:
    result = invoke("validate", "--train_batch_size", "10",
                    "--micro_train_batch_size", "3")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.splitlines()[1:] == [
        "  1. train_batch_size = 10 (from command line --train_batch_size)",
        "     problem: is not a multiple of micro_train_batch_size=3",
        "     fix: set train_batch_size to 9 or 12, or change micro_train_batch_size",
    ]


def test_validate_accepts_a_good_config_and_checks_a_world_size() -> None:
    good = invoke("validate", "--backend", "fsdp2", "--train_batch_size", "16")
    assert good.exit_code == 0, good.output
    assert good.stdout.startswith("valid: StrategyConfig: backend fsdp2,")

    fits = invoke("validate", "--train_batch_size", "16", "--world-size", "8")
    assert fits.exit_code == 0, fits.output
    assert "at world size 8: 2 gradient accumulation step(s)" in fits.stdout

    misfit = invoke("validate", "--train_batch_size", "12", "--world-size", "8")
    assert misfit.exit_code == 1
    assert "train_batch_size = 12 (from command line --train_batch_size)" in misfit.stderr
    assert "fix: set train_batch_size to a multiple of 8, e.g. 8 or 16" in misfit.stderr


def test_validate_reports_a_missing_file_and_refuses_unknown_flags(tmp_path: Path) -> None:
    missing = invoke("validate", "--config", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 1
    assert f"config file '{tmp_path / 'nope.yaml'}': no such file" in missing.stderr

    unknown = invoke("validate", "--zero_stages", "3")
    assert unknown.exit_code == 2  # a usage error, as click's own
    assert "no such option: --zero_stages (did you mean --zero_stage?)" in unknown.stderr


def test_validate_strict_refuses_names_that_are_not_fields(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("zero_stag: 3\npretrain: /models/x\n")
    lenient = invoke("validate", "--config", str(path))
    assert lenient.exit_code == 0, lenient.output  # unknown names go to extra_args

    strict = invoke("validate", "--strict", "--json", "--config", str(path))
    assert strict.exit_code == 1
    message = "not a StrategyConfig field (kept in extra_args)"
    assert json.loads(strict.stdout)["problems"] == [
        {"field": "pretrain", "value": "/models/x", "source": f"file {path}",
         "message": message, "fix": "remove it, or drop --strict"},
        {"field": "zero_stag", "value": 3, "source": f"file {path}",
         "message": message, "fix": "rename it to zero_stage"},
    ]  # fmt: skip


# -- schema and help ---------------------------------------------------------------------
def test_schema_is_the_config_json_schema() -> None:
    out = run("schema")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(json.dumps(StrategyConfig.json_schema()))


def test_help_lists_the_pass_through_flags() -> None:
    result = invoke("show", "--help")
    assert result.exit_code == 0
    assert "--config FILE" in result.stdout and "--all" in result.stdout
    assert "StrategyConfig flags:" in result.stdout
    assert all(f"--{name}" in result.stdout for name in FIELDS)
