"""The main job (examples/grpo.py) with vLLM as the rollout engine: FSDP2 on 2 ranks,
one vLLM tensor-parallel group across both, RL from the warm-up's model
(examples/warm_start.py). The training reward rises, vLLM's log-probs of what it
sampled match the trainer's, and --resume reproduces the uninterrupted run step for
step. vLLM also serves from a rank of its own (engine_placement separate), one step
off, with a LoRA adapter sent alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.timeout(900)]

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"
SAME = ("reward", "loss", "kl", "entropy", "logprob_abs_diff", "held_out_accuracy")
VLLM = ["--backend", "fsdp2", "--engine_type", "vllm", "--engine_tp_size", "2",
        "--engine_max_model_len", "32", "--sft-steps", "0", "--min-gain", "-1",
        "--recipe", "demo"]  # fmt: skip


@pytest.fixture(scope="module")
def warm_model() -> Path:
    sys.path.insert(0, str(GRPO.parent))
    from warm_start import warm_model

    return warm_model()


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _accuracy(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r}


def _full_then_resumed(tmp_path: Path, args: list[str]) -> list[dict[str, Any]]:
    full, part = tmp_path / "full", tmp_path / "part"
    run_torchrun(GRPO, *args, "--out", str(full), timeout=800)
    run_torchrun(GRPO, *args, "--stop-after", "10", "--out", str(part), timeout=800)
    run_torchrun(GRPO, *args, "--resume", "--out", str(part), timeout=800)
    rows, resumed = _metrics(full), _metrics(part)
    assert [r["step"] for r in rows] == [r["step"] for r in resumed] == list(range(21))
    for a, b in zip(rows, resumed, strict=True):
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}, a["step"]
    return rows


def test_rl_with_vllm_raises_the_training_reward_and_resumes_exactly(
    warm_model: Path, tmp_path: Path
) -> None:
    # a decaying schedule: the interrupted run must keep the 20-step horizon
    rows = _full_then_resumed(tmp_path, [*VLLM, "--pretrain", str(warm_model), "--steps", "20",
                                         "--eval-every", "10", "--save-every", "10",
                                         "--lr_scheduler", "cosine_with_min_lr"])  # fmt: skip
    # the RL objective rises: the training reward of the last 5 steps beats the first
    # 5's. (Held-out greedy accuracy after only 20 steps is noise-sized from this warm
    # model: -0.5 to -4 points in three runs on 2026-12-06, while the reward rose in
    # each; the demo session checks the held-out gain over 80 steps.)
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert sum(rewards[-5:]) > sum(rewards[:5]), rewards
    # vLLM (processed_logprobs, fp32 on CPU) against the trainer's recomputation
    gaps = [r["logprob_max_abs_diff"] for r in rows[1:]]
    assert max(gaps) < 1e-2, gaps
    assert all(0 <= r["rollout_kl"] < 1e-4 for r in rows[1:])


def test_rl_with_vllm_trains_a_lora_adapter_sent_alone(warm_model: Path, tmp_path: Path) -> None:
    """--lora_rank 8 --lora_sync adapter: vLLM (built with enable_lora) gets the adapter
    alone every step, verified; held-out accuracy rises, and --resume after an
    interruption reproduces the run step for step (the resumed run's first sync reloads
    the restored adapter)."""
    rows = _full_then_resumed(tmp_path, [
        *VLLM, "--pretrain", str(warm_model), "--steps", "20", "--eval-every", "10",
        "--save-every", "10", "--lora_rank", "8", "--lora_alpha", "32",
        "--rl-learning-rate", "2e-3", "--lora_sync", "adapter", "--verify_engine_sync",
    ])  # fmt: skip
    accuracy = _accuracy(rows)
    assert accuracy[20] > accuracy[0], accuracy


def test_vllm_on_a_rank_of_its_own_one_step_off_with_a_lora_adapter(
    warm_model: Path, tmp_path: Path
) -> None:
    """--engine_placement separate --max_staleness 1: rank 0 trains a LoRA adapter,
    rank 1 serves vLLM, which gets the adapter alone every step (each sync verified)
    and generates the next step's rollouts while rank 0 trains; every process exits 0
    and the rollouts are one version behind."""
    args = ["--backend", "fsdp2", "--engine_type", "vllm", "--engine_max_model_len", "32",
            "--sft-steps", "0", "--min-gain", "-1", "--recipe", "demo", "--pretrain",
            str(warm_model), "--steps", "8", "--eval-every", "8", "--engine_placement",
            "separate", "--max_staleness", "1", "--lora_rank", "8", "--lora_alpha", "32",
            "--rl-learning-rate", "2e-3", "--lora_sync", "adapter", "--verify_engine_sync",
            "--out", str(tmp_path)]  # fmt: skip
    run_torchrun(GRPO, *args, timeout=800)  # (raises when a rank exits non-zero)
    rl = _metrics(tmp_path)[1:]
    assert [r["weight_lag"] for r in rl] == [0] + [1] * 7
    assert [r["weight_version"] for r in rl] == list(range(1, 9))  # a sync every step
    # the first step's engine holds the model already (nothing sent); each later sync
    # moves the adapter alone, a small share of the model's bytes
    sent = [r["sync_bytes"] for r in rl]
    model_bytes = (warm_model / "model.safetensors").stat().st_size
    assert sent[0] == 0 and len(set(sent[1:])) == 1 and 0 < sent[1] < model_bytes / 4, sent


def test_two_tensor_parallel_vllm_engines_over_four_engine_ranks(
    warm_model: Path, tmp_path: Path
) -> None:
    """--engine_ranks 4 --engine_tp_size 2 on 5 processes: rank 0 trains, ranks 1-2 and
    3-4 are the tensor-parallel workers of two vLLM engines, each engine its ranks'
    process group, built one after the other (vLLM's CPU segments are named after the
    group only), each generating half of the prompts; every sync verifies, vLLM's
    log-probs of what it sampled match the trainer's, and every process exits 0."""
    args = ["--backend", "fsdp2", "--engine_type", "vllm", "--engine_max_model_len", "32",
            "--sft-steps", "0", "--min-gain", "-1", "--recipe", "demo", "--pretrain",
            str(warm_model), "--steps", "3", "--eval-every", "3", "--engine_placement",
            "separate", "--engine_ranks", "4", "--engine_tp_size", "2",
            "--verify_engine_sync", "--out", str(tmp_path)]  # fmt: skip
    nodes = run_torchrun(GRPO, *args, nproc_per_node=5, timeout=800)
    assert len(nodes) == 1  # (run_torchrun raises when a rank exits non-zero)
    rl = _metrics(tmp_path)[1:]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert max(r["logprob_max_abs_diff"] for r in rl) < 1e-2, rl
