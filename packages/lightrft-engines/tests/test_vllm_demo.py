"""The main job (examples/grpo.py) with vLLM as the rollout engine: FSDP2 on 2 ranks,
one vLLM tensor-parallel group across both; it learns, and --resume reproduces the
uninterrupted run step for step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.timeout(900)]

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict[str, Any]]) -> float:
    return sum(r["reward_mean"] for r in rows) / len(rows)


def test_grpo_demo_with_vllm_learns_and_resumes_exactly(tmp_path: Path) -> None:
    # the demo's own exit check compares 5-step windows, built for its 30 steps; over 12
    # steps with vLLM's sampling it sees +0.18, so it is relaxed here and the test makes
    # its own check below (3-step windows, +0.2)
    common = ["--backend", "fsdp2", "--engine_type", "vllm", "--engine_tp_size", "2",
              "--engine_max_model_len", "64", "--save-every", "6", "--min-gain", "0.1"]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    run_torchrun(GRPO, *common, "--steps", "12", "--out", str(full), timeout=800)
    rows = _metrics(full)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert _mean(rows[-3:]) > _mean(rows[:3]) + 0.2, [r["reward_mean"] for r in rows]
    run_torchrun(GRPO, *common, "--steps", "6", "--min-gain", "-1", "--out", str(part),
                 timeout=800)  # fmt: skip
    run_torchrun(GRPO, *common, "--steps", "12", "--resume", "--out", str(part), timeout=800)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(rows, resumed, strict=True):
        assert (a["reward_mean"], a["kl"], a["loss"]) == (b["reward_mean"], b["kl"], b["loss"]), a[
            "step"
        ]


def test_grpo_demo_with_vllm_learns_a_lora_adapter_sent_alone(tmp_path: Path) -> None:
    """--lora_rank 8 --lora_sync adapter: vLLM (built with enable_lora, one TP group of
    2) gets the adapter alone every step, verified; the reward rises, and --resume after
    an interruption reproduces the run step for step (the resumed run's first sync
    reloads the restored adapter)."""
    common = ["--backend", "fsdp2", "--engine_type", "vllm", "--engine_tp_size", "2",
              "--engine_max_model_len", "64", "--steps", "20", "--lora_rank", "8",
              "--lora_alpha", "32", "--actor_learning_rate", "3e-2", "--lora_sync", "adapter",
              "--save-every", "10", "--min-gain", "0.1"]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    run_torchrun(GRPO, *common, "--verify_engine_sync", "--out", str(full), timeout=800)
    rows = _metrics(full)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert _mean(rows[-5:]) > _mean(rows[:5]) + 0.1, [r["reward_mean"] for r in rows]
    assert all(r["weight_version"] == r["step"] + 1 for r in rows)
    run_torchrun(GRPO, *common, "--stop-after", "10", "--min-gain", "-1", "--out", str(part),
                 timeout=800)  # fmt: skip
    run_torchrun(GRPO, *common, "--resume", "--out", str(part), timeout=800)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    for a, b in zip(rows, resumed, strict=True):
        assert (a["reward_mean"], a["kl"], a["loss"]) == (b["reward_mean"], b["kl"], b["loss"]), a[
            "step"
        ]
