"""The main job (examples/grpo.py) on the fake strategy, in one process: with the HF
engine and with the fake engine (which samples from the model the demo names, its
weights replaced by every sync) it learns, and resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


def _run(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(GRPO), "--backend", "fake", *args],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_fake_strategy_with_the_hf_engine_learns(tmp_path: Path) -> None:
    _run("--engine_type", "hf", "--steps", "12", "--out", str(tmp_path))
    rewards = [r["reward_mean"] for r in _metrics(tmp_path)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


@pytest.mark.timeout(600)
def test_fake_strategy_and_fake_engine_learn_and_resume_exactly(tmp_path: Path) -> None:
    fake = ["--engine_type", "fake", "--min-gain", "-1", "--save-every", "3", "--steps", "12"]
    _run(*fake, "--out", str(tmp_path / "full"))
    _run(*fake, "--stop-after", "6", "--out", str(tmp_path / "part"))
    _run(*fake, "--resume", "--out", str(tmp_path / "part"))
    full, resumed = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    rewards = [r["reward_mean"] for r in full]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert [r["step"] for r in full] == [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(full, resumed, strict=True):
        assert (a["reward_mean"], a["kl"], a["loss"]) == (b["reward_mean"], b["kl"], b["loss"])


@pytest.mark.timeout(600)
def test_the_fake_engine_keeps_its_output_rule_when_asked(tmp_path: Path) -> None:
    """``sample_from_model=False``: completions by the documented rule, not from the
    model, so the policy cannot learn from them (the reward stays near its start)."""
    config = tmp_path / "grpo.yaml"  # the demo's settings, and an engine option
    config.write_text(
        (GRPO.parent / "grpo.yaml").read_text() + "engine_options: {sample_from_model: false}\n"
    )
    _run("--config", str(config), "--engine_type", "fake", "--min-gain", "-1", "--steps", "6",
         "--out", str(tmp_path / "run"))  # fmt: skip
    rewards = [r["reward_mean"] for r in _metrics(tmp_path / "run")]
    assert len(rewards) == 6 and max(rewards) < 0.35, rewards


@pytest.mark.timeout(600)
def test_the_demo_runs_with_a_level_2_sleeping_engine(tmp_path: Path) -> None:
    """A level-2 sleep discards the engine's weights: the demo syncs before it generates,
    so each generation has the weights (it failed at step 1 when it synced after
    training)."""
    _run("--engine_type", "fake", "--min-gain", "-1", "--steps", "3", "--out", str(tmp_path),
         "--enable_engine_sleep", "--engine_sleep_level", "2")  # fmt: skip
    rows = _metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == [2, 3, 4]  # setup's sync, then each step's
