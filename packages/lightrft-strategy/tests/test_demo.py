"""The main job (examples/grpo.py, the README's first command) shortened: it learns on
every strategy that runs on CPU with the HF engine, and --resume reproduces the
uninterrupted run step for step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_torchrun

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"
BACKENDS = [
    pytest.param(["--backend", "fsdp2"], id="fsdp2"),
    pytest.param(
        ["--backend", "deepspeed", "--zero_stage", "3"], id="zero3", marks=pytest.mark.deepspeed
    ),
]


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict[str, Any]]) -> float:
    return sum(r["reward_mean"] for r in rows) / len(rows)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_demo_learns_and_resumes_exactly(backend: list[str], tmp_path: Path) -> None:
    # a decaying schedule: the interrupted run must keep the 12-step horizon
    common = [*backend, "--engine_type", "hf", "--save-every", "6",
              "--lr_scheduler", "cosine_with_min_lr"]  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    run_torchrun(GRPO, *common, "--steps", "12", "--out", str(full), timeout=600)
    rows = _metrics(full)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert _mean(rows[-3:]) > _mean(rows[:3]) + 0.2, [r["reward_mean"] for r in rows]
    assert all(r["weight_version"] == r["step"] + 1 for r in rows)  # synced every step
    assert (full / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_torchrun(GRPO, *common, "--steps", "12", "--stop-after", "6", "--min-gain", "-1",
                 "--out", str(part), timeout=600)  # fmt: skip
    assert [r["step"] for r in _metrics(part)] == list(range(1, 7))
    run_torchrun(GRPO, *common, "--steps", "12", "--resume", "--out", str(part), timeout=600)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(rows, resumed, strict=True):  # exact on CPU: seeded rollouts, restored state
        assert (a["reward_mean"], a["kl"], a["loss"]) == (b["reward_mean"], b["kl"], b["loss"]), a[
            "step"
        ]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_grpo_demo_learns_with_a_lora_adapter(tmp_path: Path) -> None:
    """--lora_rank 8: a peft adapter is trained (the base frozen) and the HF engine is
    synced merged every step; the reward rises (a LoRA adapter learns slower than the
    full model at the same step count: a larger learning rate and alpha), and --resume
    after an interruption reproduces the run step for step."""
    common = ["--engine_type", "hf", "--steps", "12", "--lora_rank", "8", "--lora_alpha", "32",
              "--actor_learning_rate", "3e-2", "--save-every", "6",
              "--min-gain", "0.1"]  # fmt: skip
    out, part = tmp_path / "lora", tmp_path / "part"
    run_torchrun(GRPO, *common, "--out", str(out), timeout=600)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert _mean(rows[-3:]) > _mean(rows[:3]) + 0.15, [r["reward_mean"] for r in rows]
    assert all(r["weight_version"] == r["step"] + 1 for r in rows)
    # interrupted after step 6 and resumed: the LoRA run continues step for step
    run_torchrun(GRPO, *common, "--stop-after", "6", "--min-gain", "-1", "--out", str(part),
                 timeout=600)  # fmt: skip
    run_torchrun(GRPO, *common, "--resume", "--out", str(part), timeout=600)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(rows, resumed, strict=True):
        assert (a["reward_mean"], a["kl"], a["loss"]) == (b["reward_mean"], b["kl"], b["loss"]), a[
            "step"
        ]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_grpo_demo_runs_as_a_two_node_job_with_a_sleeping_engine(tmp_path: Path) -> None:
    """Also the engine's sleep (level 1, upstream's): it sleeps after each generation,
    update_engine_weights wakes it, and the check that the engine generates from the
    trainer's weights runs at every sync."""
    nodes = run_torchrun(
        GRPO, "--steps", "8", "--min-gain", "0.1", "--out", str(tmp_path),
        "--enable_engine_sleep", "--verify_engine_sync",
        nnodes=2, nproc_per_node=1, timeout=500,
    )  # fmt: skip
    assert len(nodes) == 2
    rows = _metrics(tmp_path)
    assert len(rows) == 8 and _mean(rows[-3:]) > _mean(rows[:3])
    assert all(r["weight_version"] == r["step"] + 1 for r in rows)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_grpo_demo_at_sp_size_2_trains_as_at_sp_size_1(tmp_path: Path) -> None:
    """The same config on 2 ranks at sp_size=2 (one data-parallel replica whose sequences
    are split in half) and on 1 rank at sp_size=1 (one replica, whole sequences): the same
    rollouts, rewards, losses and KL step by step."""
    runs = {}
    for sp in (1, 2):
        out = tmp_path / f"sp{sp}"
        (node,) = run_torchrun(GRPO, "--steps", "3", "--min-gain", "-1", "--sp_size", str(sp),
                               "--out", str(out), nproc_per_node=sp, timeout=500)  # fmt: skip
        runs[sp] = _metrics(out)
        split = "Qwen2Model's sequences split over 2 ranks, attention 'sdpa' on 1/2 of the heads"
        assert (split in node.stderr) == (sp == 2), node.stderr[-2000:]
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    for one, two in zip(runs[1], runs[2], strict=True):
        assert one["reward_mean"] == two["reward_mean"], one["step"]  # same rollouts
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5), one["step"]
        assert two["kl"] == pytest.approx(one["kl"], abs=1e-6), one["step"]
