"""DeepSpeed (ZeRO 0-3) on 2 real gloo ranks with DeepSpeed's CPU accelerator.

Tolerances: fp32 throughout unless named; parity with the unsharded reference and
with FSDP2 within rtol 1e-5 / atol 1e-6 (reduction order differs); resume bit for
bit; EMA within rtol 1e-5 of the EMA of the unsharded reference.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch

from lightrft.strategy.checkpoint.layout import METADATA_FILE
from lightrft.testing.launcher import run_distributed

from . import ds_workers, workers

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.timeout(400)]

PARITY = {
    "zero0": {"backend": "deepspeed", "zero_stage": 0},
    "zero1": {"backend": "deepspeed", "zero_stage": 1},
    "zero2": {"backend": "deepspeed", "zero_stage": 2},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
    "fsdp2": {"backend": "fsdp2"},
}
_losses: dict[str, list[float]] = {}


def test_a_cpu_job_builds_no_deepspeed_op(tmp_path: Path) -> None:
    """DeepSpeed's communication layer JIT-compiles a shared-memory all-reduce op (only
    AutoTP inference uses it) on first use: 38 s here on an empty extensions directory,
    inside the first collective's timeout. A ZeRO-3 job on CPU builds none of it."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    ranks = run_distributed(ds_workers.jit_ops_case, 2, 3, env=env, timeout=120)
    assert ranks[0] == ranks[1] == {"built": [], "shm_op_loaded": False}


@pytest.mark.parametrize("name", list(PARITY))
def test_zero_stages_and_fsdp2_match_unsharded_training(name: str) -> None:
    cfg = workers.config(**PARITY[name])
    steps = 5
    ranks = run_distributed(workers.train, 2, cfg, steps, init_process_group=False, timeout=300)
    assert len(ranks[0]["used"]) == steps * 2  # accumulation: 8 / (2 micro x 2 ranks)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert max(ranks[0]["norms"]) > cfg["max_norm"], "clipping was never active"
    ref = workers.reference(cfg, steps, [r["used"] for r in ranks])
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    workers.assert_states_close(ranks[0]["state"], ref["state"], rtol=1e-5, atol=1e-6)
    assert all(t.dtype == torch.float32 for t in ranks[0]["state"].values())
    _losses[name] = ranks[0]["losses"]
    # every backend run so far agrees with every other, not only with the reference
    for other, losses in _losses.items():
        torch.testing.assert_close(losses, ranks[0]["losses"], rtol=1e-5, atol=1e-6, msg=other)


@pytest.mark.parametrize("stage", [2, 3])
def test_models_built_differently_per_rank_take_rank0_weights(stage: int) -> None:
    """Each rank seeds differently before building (rank 0 as the reference does).
    Stage 2 with meta_init: ranks other than 0 build on the meta device and get rank
    0's weights when prepared; stage 3: zero.Init broadcasts rank 0's values."""
    cfg = ds_workers.ds(stage)
    ranks = run_distributed(
        workers.train, 2, cfg, 2, meta_init=True, init_process_group=False, timeout=300
    )
    assert [r["built_on_meta"] for r in ranks] == ([False, True] if stage == 2 else [False] * 2)
    ref = workers.reference(cfg, 2, [r["used"] for r in ranks])
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    workers.assert_states_close(ranks[0]["state"], ref["state"], rtol=1e-5, atol=1e-6)


def test_zero3_bf16_stays_close_to_fp32_training() -> None:
    """bf16 weights, fp32 master weights. The model is built outside
    init_model_context: under ZeRO-3 that context builds parameters in bf16, and
    torch's bf16 initialisers differ from fp32 ones (a value that rounds up to the
    upper bound is drawn as the lower bound), which no tolerance on training covers."""
    cfg = workers.config(backend="deepspeed", zero_stage=3, precision="bf16")
    ranks = run_distributed(
        workers.train, 2, cfg, 5, init_context=False, init_process_group=False, timeout=300
    )
    ref = workers.reference(cfg, 5, [r["used"] for r in ranks])
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=2e-2, atol=2e-3)
    for name, value in ranks[0]["state"].items():  # fp32 master weights, as FSDP2
        error = torch.linalg.vector_norm(value - ref["state"][name])
        assert error <= 2e-2 * torch.linalg.vector_norm(ref["state"][name]), name
    assert all(t.dtype == torch.float32 for t in ranks[0]["state"].values())


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_bit_exact_with_dropout_and_a_mid_epoch_loader(
    stage: int, tmp_path: Path
) -> None:
    cfg = ds_workers.ds(stage, lr_warmup_ratio=0.5, lr_scheduler="cosine_with_min_lr")
    net = partial(workers.TinyRegressor, dropout=0.1)
    run = {"model": net, "max_steps": 6, "init_process_group": False, "timeout": 300}
    full = run_distributed(workers.train, 2, cfg, 6, **run)
    first = run_distributed(workers.train, 2, cfg, 3, save_dir=str(tmp_path), **run)
    second = run_distributed(workers.train, 2, cfg, 3, load_dir=str(tmp_path), **run)
    assert first[0]["losses"] + second[0]["losses"] == full[0]["losses"]
    for rank in range(2):
        assert first[rank]["used"] + second[rank]["used"] == full[rank]["used"]
    workers.assert_states_close(second[0]["state"], full[0]["state"], rtol=0, atol=0)
    assert second[0]["lr"] == full[0]["lr"]
    tag = tmp_path / "global_step3"
    metadata = json.loads((tag / METADATA_FILE).read_text())
    assert metadata["backend"] == "deepspeed"
    assert metadata["backend_info"]["zero_stage"] == stage
    # DeepSpeed's own engine files sit in the tag directory: its own tool reads them
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert (tmp_path / "zero_to_fp32.py").is_file()  # DeepSpeed's recovery script
    converted = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="global_step3")
    workers.assert_states_close(dict(converted), first[0]["state"], rtol=0, atol=0)


def test_checkpoint_of_another_stage_or_world_size_is_refused(tmp_path: Path) -> None:
    run = {"init_process_group": False, "timeout": 300}
    run_distributed(ds_workers.teardown_case, 2, 2, str(tmp_path), **run)
    tag = tmp_path / "global_step1"
    before = {p.name: p.stat().st_size for p in tag.iterdir()}
    errors = run_distributed(ds_workers.load_case, 2, 3, str(tmp_path), **run)
    assert errors[0] == errors[1]
    assert "CheckpointError" in errors[0]
    assert "saved at ZeRO stage 2, this run uses zero_stage=3" in errors[0]
    assert "Resume with zero_stage=2" in errors[0]
    (single,) = run_distributed(ds_workers.load_case, 1, 2, str(tmp_path), **run)
    assert "saved at world size 2, this run has 1 ranks" in single
    assert {p.name: p.stat().st_size for p in tag.iterdir()} == before  # nothing touched


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resumed_run_clips_at_its_own_max_norm(stage: int, tmp_path: Path) -> None:
    """ZeRO's optimizers restore the clipping a checkpoint was saved with (0.3 here);
    the resumed run's max_norm decides."""
    run = {"init_process_group": False, "timeout": 300}
    run_distributed(ds_workers.teardown_case, 2, stage, str(tmp_path), **run)
    clips = run_distributed(ds_workers.clip_after_load_case, 2, stage, str(tmp_path), 2.5, **run)
    assert clips == [2.5, 2.5]


def test_ema_of_zero3_model_equals_ema_of_unsharded_training() -> None:
    cfg = ds_workers.ds(3)
    ranks = run_distributed(
        workers.train, 2, cfg, 3, ema_beta=0.9, init_process_group=False, timeout=300
    )
    ref = workers.reference(cfg, 3, [r["used"] for r in ranks], ema_beta=0.9)
    ema = ranks[0]["ema"]
    assert ema["sharded"] is True  # the prepared EMA model is partitioned like the actor
    workers.assert_states_close(ema["prepared"], ref["ema"], rtol=1e-5, atol=1e-6)
    workers.assert_states_close(ema["plain"], ref["ema"], rtol=1e-5, atol=1e-6)


def test_zero3_save_model_writes_hf_safetensors_that_reload_identically(
    tmp_path: Path,
) -> None:
    import transformers

    out = tmp_path / "hf"
    ranks = run_distributed(
        ds_workers.save_model_case, 2, str(out), 3, init_process_group=False, timeout=300
    )
    assert ranks[0]["stepped"] is True
    assert ranks[0]["partitioned"] is True  # built under zero.Init: each rank a shard
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=torch.arange(16).reshape(1, 16) % 128).logits
    torch.testing.assert_close(logits, ranks[0]["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_prepare_shapes_configs_and_overlay(stage: int) -> None:
    facts = run_distributed(ds_workers.prepare_case, 2, stage, init_process_group=False)[0]
    assert facts["engines"] == [True] * 6
    assert facts["eval_mode"] == [True] * 4
    assert facts["unwrapped"] == "TinyRegressor"
    assert facts["train_stage"] == stage
    assert facts["eval_stage"] == (3 if stage == 3 else 0)
    assert facts["bucket"] == 123456  # the user's overlay reached the engine
    assert facts["gas"] == 2 and facts["train_batch"] == 8
    assert facts["clipping"] == (0.0 if stage == 0 else 0.3)  # stage 0 fp32: we clip
    assert facts["sched_is_engines"] is True
    assert facts["stepped"] == [False, True]
    assert (facts["critic_steps"], facts["actor_steps"]) == (1, 0)
    assert facts["ref_out_shape"] == (2, 4)
    assert facts["ckpt_engine"] == "SafeTorchCheckpointEngine"
    assert facts["train_config"]["zero_optimization"]["reduce_bucket_size"] == 123456
    assert facts["eval_config"]["zero_optimization"]["stage"] == (3 if stage == 3 else 0)
    assert facts["a_opt_type"] == (
        "AdamW" if stage == 0 else "DeepSpeedZeroOptimizer" + ("_Stage3" if stage == 3 else "")
    )


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")]
)
def test_nonfinite_gradients_skip_the_step_on_every_stage(stage: int, precision: str) -> None:
    result = run_distributed(
        ds_workers.nonfinite_case, 2, stage, precision, init_process_group=False
    )[0]
    assert result["skipped"] is True and result["applied"] is True
    assert result["unchanged"] is True and result["changed"] is True
    assert result["finite"] is True
    lr_before, lr_after_skip, lr_after_step = result["lr"]
    assert lr_after_skip == lr_before != lr_after_step  # the skip did not advance the LR
    assert result["counters"] == (1, 1, 2)


def test_consecutive_zero3_jobs_exit_cleanly(tmp_path: Path) -> None:
    """Each launch fails (RankFailure) if any rank exits non-zero or is killed by a
    signal, e.g. an abort during interpreter teardown. CI runs 2 launches
    (test_launches.py runs ZeRO-3 under torchrun too); LIGHTRFT_TEARDOWN_JOBS=20 (or
    more) makes it a stress run."""
    for job in range(int(os.environ.get("LIGHTRFT_TEARDOWN_JOBS", "2"))):
        steps = run_distributed(
            ds_workers.teardown_case, 2, 3, str(tmp_path), init_process_group=False
        )
        assert steps == [1, 1], f"job {job}"


class _Payload:
    """Unpickling this runs code: a crafted checkpoint file's attack."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_deepspeed_engine_files_are_read_without_arbitrary_unpickling(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from lightrft.strategy.checkpoint.layout import CheckpointError
    from lightrft.strategy.deepspeed.safe_checkpoint import SafeTorchCheckpointEngine

    engine = SafeTorchCheckpointEngine()
    good = tmp_path / "good.pt"
    torch.save(  # what DeepSpeed's own files hold besides tensors
        {"w": torch.ones(2), "loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(2)},
        good,
    )
    loaded = engine.load(str(good))
    assert torch.equal(loaded["w"], torch.ones(2)) and loaded["zero_stage"] == 2
    marker = tmp_path / "pwned"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": _Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt holds objects"):
        engine.load(str(bad))
    assert not marker.exists()


def test_zero3_load_model_gathers_nothing_wrong_and_refuses_bad_files(tmp_path: Path) -> None:
    torch.manual_seed(5)
    source = workers.TinyRegressor()
    weights = tmp_path / "weights.pt"
    torch.save(source.state_dict(), weights)
    cfg = workers.config(backend="deepspeed", zero_stage=3)
    ranks = run_distributed(
        workers.load_model_case, 2, cfg, str(weights), True, init_process_group=False,
        timeout=300,
    )  # fmt: skip
    workers.assert_states_close(ranks[0]["untouched"], ranks[0]["before"], rtol=0, atol=0)
    workers.assert_states_close(ranks[0]["loaded"], source.state_dict(), rtol=0, atol=0)
    with torch.no_grad():
        want = source(torch.linspace(-1, 1, 2 * workers.DIM).reshape(2, workers.DIM))
    for result in ranks:
        torch.testing.assert_close(result["output"], want, rtol=1e-6, atol=1e-6)
        assert set(result["errors"]) == {"strict_partial", "renamed", "corrupt", "missing"}


def test_zero3_deferred_setup_refuses_use_until_set_up() -> None:
    cfg = workers.config(backend="deepspeed", zero_stage=3)
    ranks = run_distributed(workers.deferred_use_case, 2, cfg, init_process_group=False)
    for result in ranks:
        assert all(e and e.startswith("NotSetUpError") for e in result["errors"].values())
        assert result["world"] == 2 and result["accumulated"] == 2


def test_a_plain_process_trains_with_deepspeed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No launcher (no LOCAL_RANK): a world of one still builds DeepSpeed engines."""
    from torch import nn

    from lightrft.strategy import get_strategy

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    strategy = get_strategy({"backend": "deepspeed", "zero_stage": 0, "precision": "bf16",
                             "device": "cpu", "train_batch_size": 2,
                             "micro_train_batch_size": 2, "actor_learning_rate": 1e-3})  # fmt: skip
    torch.manual_seed(0)
    (model, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        nn.Linear(8, 8), None, None, None, None, 4
    )
    for _ in range(3):
        loss = model(torch.randn(2, 8)).float().pow(2).mean()
        strategy.backward(loss, model, optim)
        assert strategy.optimizer_step(optim, model, sched)
    assert strategy.step_state(model).global_steps == 3
    strategy.close()
    os.environ.pop("LOCAL_RANK", None)  # set by the strategy for DeepSpeed; not ours to keep


def test_zero3_from_pretrained_loads_into_partitions_after_another_hf_config(
    tmp_path: Path,
) -> None:
    import transformers

    from lightrft.testing.models import save_tiny_qwen2

    model_dir = save_tiny_qwen2(tmp_path / "model")
    (got,) = run_distributed(
        ds_workers.from_pretrained_after_a_dropped_hf_config_case, 1, str(model_dir),
        init_process_group=False,
    )  # fmt: skip
    assert got["enabled"] and got["partitioned"]
    want = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert got["sum"] == pytest.approx(float(sum(v.double().sum() for v in want.values())))
