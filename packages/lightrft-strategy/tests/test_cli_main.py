"""The ``lightrft`` command itself: it mounts lightrft-config's ``config`` group (the
commands are tested there, through ``python -m lightrft.config``) and loads no torch
for help or configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lightrft.config.cli import config
from lightrft.strategy.cli import cli

SCRIPT = Path(sys.executable).with_name("lightrft")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("LIGHTRFT_")}


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, env=_clean_env(), timeout=120)


def test_lightrft_config_is_the_config_packages_command() -> None:
    context = cli.make_context("lightrft", ["config"], resilient_parsing=True)
    assert cli.get_command(context, "config") is config
    result = CliRunner().invoke(cli, ["config", "validate", "--train_batch_size", "10",
                                      "--micro_train_batch_size", "3"])  # fmt: skip
    assert result.exit_code == 1
    assert "fix: set train_batch_size to 9 or 12" in result.stderr


def test_the_installed_script_and_python_m_give_the_same_answer() -> None:
    assert SCRIPT.is_file(), f"no {SCRIPT}: (re)install lightrft-strategy in this environment"
    args = ["config", "show", "--zero_stage", "3", "--seed", "5"]
    script = _run(str(SCRIPT), *args)
    module = _run(sys.executable, "-m", "lightrft.config", *args[1:])
    assert script.returncode == module.returncode == 0, script.stderr + module.stderr
    assert script.stdout == module.stdout
    assert "zero_stage" in script.stdout


@pytest.mark.parametrize(
    "args", [["--help"], ["config", "--help"], ["config", "show", "--zero_stage", "3"]]
)
def test_help_and_config_commands_import_no_torch(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightrft.strategy.cli", *args],
        capture_output=True, text=True, env=_clean_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "click" in imported
    heavy = {"torch", "deepspeed", "transformers", "vllm", "sglang", "numpy"}
    assert not imported & heavy, sorted(imported & heavy)
