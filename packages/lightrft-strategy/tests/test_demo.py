"""The main job (examples/grpo.py, the README's first command) shortened. One warm-up
(the fake strategy, in one process: examples/warm_start.py) gives the model every test
starts RL from
(``--pretrain`` a saved model, ``--sft-steps 0``); RL then raises its held-out
accuracy on every strategy that runs on CPU with the HF engine, the rollout log-probs
match the trainer's, TensorBoard holds what metrics.jsonl holds, and --resume
reproduces the uninterrupted run step for step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.testing.launcher import run_torchrun

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"
BACKENDS = [
    pytest.param(["--backend", "fsdp2"], id="fsdp2"),
    pytest.param(
        ["--backend", "deepspeed", "--zero_stage", "3"], id="zero3", marks=pytest.mark.deepspeed
    ),
]
#: Compared exactly between an uninterrupted and a resumed run.
SAME = ("reward", "loss", "kl", "entropy", "logprob_abs_diff", "held_out_accuracy")


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _accuracy(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r}


@pytest.fixture(scope="module")
def warm_model() -> Path:
    """The supervised warm-up's model (150 steps on the fake strategy; once per checkout,
    examples/warm_start.py, which checks that it learned)."""
    sys.path.insert(0, str(GRPO.parent))
    from warm_start import warm_model

    return warm_model()


def _rl(warm: Path, *args: str) -> list[str]:
    """RL from the warm-up's model with the demo's tuned rates (not --pretrain's)."""
    return ["--pretrain", str(warm), "--recipe", "demo", "--sft-steps", "0", "--min-gain", "-1",
            *args]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_raises_held_out_accuracy_and_resumes_exactly(
    backend: list[str], warm_model: Path, tmp_path: Path
) -> None:
    # a decaying schedule: the interrupted run must keep the 20-step horizon
    common = _rl(warm_model, *backend, "--engine_type", "hf", "--steps", "20", "--eval-every",
                 "10", "--save-every", "10", "--lr_scheduler", "cosine_with_min_lr")  # fmt: skip
    full, part = tmp_path / "full", tmp_path / "part"
    run_torchrun(GRPO, *common, "--out", str(full), timeout=600)
    rows = _metrics(full)
    assert [r["step"] for r in rows] == list(range(21))
    accuracy = _accuracy(rows)
    assert list(accuracy) == [0, 10, 20] and accuracy[20] > accuracy[0], accuracy
    rl = rows[1:]
    # the HF engine in fp32 samples from the trainer's own distribution: the gap is
    # rounding (measured up to 1.3e-5 nats), far under 1e-3
    assert all(0 <= r["logprob_max_abs_diff"] < 1e-3 for r in rl), [
        r["logprob_max_abs_diff"] for r in rl
    ]
    assert all(0 <= r["rollout_kl"] < 1e-6 for r in rl)
    versions = [r["weight_version"] for r in rl]
    assert versions == sorted(set(versions)), versions  # a sync every step
    assert (full / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _assert_tensorboard_holds(full / "tensorboard", rows)
    _assert_export_loads_with_its_tokenizer(full, tmp_path / "export")
    if backend[1] != "fsdp2":
        return  # the interrupted run once (FSDP2): ZeRO-3's resume is test_deepspeed's
    run_torchrun(GRPO, *common, "--stop-after", "10", "--out", str(part), timeout=600)
    assert [r["step"] for r in _metrics(part)] == list(range(11))
    run_torchrun(GRPO, *common, "--resume", "--out", str(part), timeout=600)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(21))
    for a, b in zip(rows, resumed, strict=True):  # exact on CPU: seeded rollouts, restored state
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}, a["step"]


def _assert_export_loads_with_its_tokenizer(run: Path, out: Path) -> None:
    """``lightrft ckpt export`` of the run's last checkpoint is a model directory that
    loads as it is, tokenizer included, with the finished run's weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lightrft = str(Path(sys.executable).with_name("lightrft"))
    done = subprocess.run([lightrft, "ckpt", "export", str(run / "checkpoints"), "--to", "hf",
                           str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(run / "final_model")
    assert tokenizer("07+25=").input_ids == original("07+25=").input_ids
    AutoModelForCausalLM.from_pretrained(out)
    exported, final = (
        load_file(str(out / "model.safetensors")),
        load_file(str(run / "final_model" / "model.safetensors")),
    )
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)


def _assert_tensorboard_holds(directory: Path, rows: list[dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    for key in ("reward", "held_out_accuracy", "logprob_abs_diff", "rollout_kl", "entropy"):
        want = {r["step"]: r[key] for r in rows if key in r}
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx(want, rel=1e-6), key


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rl_trains_a_lora_adapter(warm_model: Path, tmp_path: Path) -> None:
    """--lora_rank 8: a peft adapter is trained (the base frozen) and the HF engine is
    synced merged every step; held-out accuracy rises, and --resume after an
    interruption reproduces the run step for step."""
    common = _rl(warm_model, "--engine_type", "hf", "--steps", "20", "--lora_rank", "8",
                 "--lora_alpha", "32", "--rl-learning-rate", "2e-3", "--eval-every", "10",
                 "--save-every", "10")  # fmt: skip
    out, part = tmp_path / "lora", tmp_path / "part"
    run_torchrun(GRPO, *common, "--out", str(out), timeout=600)
    rows = _metrics(out)
    accuracy = _accuracy(rows)
    assert accuracy[20] > accuracy[0], accuracy
    run_torchrun(GRPO, *common, "--stop-after", "10", "--out", str(part), timeout=600)
    run_torchrun(GRPO, *common, "--resume", "--out", str(part), timeout=600)
    for a, b in zip(rows, _metrics(part), strict=True):
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}, a["step"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rl_runs_as_a_two_node_job_with_a_sleeping_engine(warm_model: Path, tmp_path: Path) -> None:
    """Also the engine's sleep (level 1, upstream's): it sleeps after each generation,
    update_engine_weights wakes it, and the check that the engine generates from the
    trainer's weights runs at every sync."""
    nodes = run_torchrun(
        GRPO, *_rl(warm_model, "--steps", "20", "--eval-every", "20", "--lr_scheduler",
                   "cosine_with_min_lr"), "--out", str(tmp_path),
        "--enable_engine_sleep", "--verify_engine_sync",
        nnodes=2, nproc_per_node=1, timeout=500,
    )  # fmt: skip
    assert len(nodes) == 2
    accuracy = _accuracy(_metrics(tmp_path))
    assert accuracy[20] > accuracy[0], accuracy


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rl_at_sp_size_2_trains_as_at_sp_size_1(warm_model: Path, tmp_path: Path) -> None:
    """The same config on 2 ranks at sp_size=2 (one data-parallel replica whose sequences
    are split in half) and on 1 rank at sp_size=1 (one replica, whole sequences): the same
    rollouts, rewards, losses and KL step by step, and the same held-out KL."""
    runs = {}
    for sp in (1, 2):
        out = tmp_path / f"sp{sp}"
        # --kl-coef: the reference model's forward runs (the demo skips it at 0)
        (node,) = run_torchrun(GRPO, *_rl(warm_model, "--steps", "3", "--sp_size", str(sp),
                                          "--kl-coef", "0.001"),
                               "--out", str(out), nproc_per_node=sp, timeout=500)  # fmt: skip
        runs[sp] = _metrics(out)[1:]
        split = "Qwen2Model's sequences split over 2 ranks, attention 'sdpa' on 1/2 of the heads"
        assert (split in node.stderr) == (sp == 2), node.stderr[-2000:]
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    for one, two in zip(runs[1], runs[2], strict=True):
        assert one["reward"] == two["reward"], one["step"]  # same rollouts
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5), one["step"]
        assert two["kl"] == pytest.approx(one["kl"], abs=1e-6), one["step"]
    # the held-out KL (step 3's evaluation) through the same split forward
    assert runs[2][-1]["held_out_kl"] == pytest.approx(runs[1][-1]["held_out_kl"], abs=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rl_one_step_off_with_the_engine_on_its_own_node(warm_model: Path, tmp_path: Path) -> None:
    """--engine_placement separate --max_staleness 1 as a 2-node loopback job: node 0's
    rank trains, node 1's rank serves the engine; each step's rollouts were generated
    during the last step's training from the weights before it (weight_lag 1), every
    process exits 0, and the training reward rises. Interrupted after step 10 (step
    11's rollouts in flight) and resumed, the run repeats the uninterrupted one step for
    step: the checkpoint held those rollouts."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = [*_rl(warm_model, "--steps", "20", "--eval-every", "10"), "--engine_placement",
              "separate", "--max_staleness", "1"]  # fmt: skip

    def run(out: Path, *args: str) -> None:
        nodes = run_torchrun(GRPO, *common, *args, "--out", str(out), nnodes=2,
                             nproc_per_node=1, timeout=500)  # fmt: skip
        assert len(nodes) == 2  # (run_torchrun raises when a node exits non-zero)

    run(full)
    rows = _metrics(full)
    rl = rows[1:]
    assert [r["weight_lag"] for r in rl] == [0] + [1] * 19
    assert [r["weight_version"] for r in rl] == list(range(1, 21))  # a sync every step
    first, last = (sum(r["reward"] for r in part) / 5 for part in (rl[:5], rl[-5:]))
    assert last > first, [r["reward"] for r in rl]
    run(part, "--stop-after", "10")
    assert (part / "checkpoints" / "global_step10" / "rollouts" / "rank0.pt").is_file()
    run(part, "--resume")
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(21))
    for a, b in zip(rows, resumed, strict=True):
        same = (*SAME, "weight_lag", "logprob_max_abs_diff")
        assert {k: a.get(k) for k in same} == {k: b.get(k) for k in same}, a["step"]
