"""``python -m lightrft.config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightrft.config", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_schema_command_prints_the_schema() -> None:
    result = run("schema")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["title"] == "StrategyConfig"


def test_show_layers_file_env_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\nzero_stage: 1\n")
    result = run("show", "--config", str(path), "--zero_stage", "3", env={"LIGHTRFT_SEED": "4"})
    assert result.returncode == 0, result.stderr
    assert "zero_stage = 3  (default 2)" in result.stdout
    assert '"seed": 4' in result.stdout


def test_show_reports_bad_values_without_a_traceback() -> None:
    result = run("show", "--zero_stage", "7")
    assert result.returncode == 2
    assert "zero_stage=7 (from command line --zero_stage)" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_command_prints_usage_and_fails() -> None:
    result = run("frobnicate")
    assert result.returncode == 2
    assert "python -m lightrft.config schema" in result.stdout
