"""CUDA checks: run by `nox -s gpu` on a machine with a GPU (deselected elsewhere).

They fail, not skip, when CUDA is missing: selecting them says a GPU is expected.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from lightrft.testing.launcher import run_distributed

from . import workers

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _gpus() -> int:
    assert torch.cuda.is_available(), "the gpu tests need CUDA"
    return torch.cuda.device_count()


def test_fsdp2_on_cuda_matches_unsharded_training() -> None:
    world = min(2, _gpus())
    cfg = workers.config(device="cuda", train_batch_size=4 * world, micro_train_batch_size=2)
    ranks = run_distributed(workers.train, world, cfg, 4, init_process_group=False)
    ref = workers.reference(cfg, 4, [r["used"] for r in ranks])
    # TF32 matmuls are off by default for fp32 in torch; CUDA reductions reorder sums
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=1e-4, atol=1e-5)
    workers.assert_states_close(ranks[0]["state"], ref["state"], rtol=1e-4, atol=1e-5)


def test_cuda_resume_and_optimizer_offload(tmp_path: Path) -> None:
    world = min(2, _gpus())
    cfg = workers.config(device="cuda", train_batch_size=4 * world, micro_train_batch_size=2)
    run = {"model": partial(workers.TinyRegressor, dropout=0.1), "init_process_group": False}
    full = run_distributed(workers.train, world, cfg, 4, **run)
    run_distributed(workers.train, world, cfg, 2, save_dir=str(tmp_path), **run)
    second = run_distributed(workers.train, world, cfg, 2, load_dir=str(tmp_path), **run)
    workers.assert_states_close(second[0]["state"], full[0]["state"], rtol=0, atol=0)
    moved = run_distributed(workers.offload_case, 1, init_process_group=False)[0]
    assert moved == {"offloaded": "cpu", "reloaded": "cuda", "unchanged": True}


def test_bf16_on_cuda_tracks_the_fp32_reference() -> None:
    """bf16 compute, fp32 master weights and fp32 gradient reduction: close to the plain
    fp32 run, not equal (the CPU test's tolerance)."""
    _gpus()
    cfg = workers.config(device="cuda", precision="bf16", train_batch_size=4)
    steps = 6
    ranks = run_distributed(workers.train, 1, cfg, steps, init_process_group=False)
    ref = workers.reference(cfg, steps, [ranks[0]["used"]])
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=2e-2, atol=2e-3)
    for name, value in ranks[0]["state"].items():  # Adam flips the odd element: as a whole
        error = torch.linalg.vector_norm(value - ref["state"][name])
        assert error <= 2e-2 * torch.linalg.vector_norm(ref["state"][name]), name
    assert all(t.dtype == torch.float32 for t in ranks[0]["state"].values())


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cuda_matches_unsharded_training(stage: int) -> None:
    world = min(2, _gpus())
    cfg = workers.config(
        backend="deepspeed",
        zero_stage=stage,
        device="cuda",
        train_batch_size=4 * world,
        micro_train_batch_size=2,
    )
    # ZeRO-3 builds the model under deepspeed.zero.Init, which on CUDA draws the random
    # weights on the GPU (another generator than the reference's): start from the same
    ranks = run_distributed(
        workers.train, world, cfg, 4, record_initial=True, init_process_group=False
    )
    ref = workers.reference(cfg, 4, [r["used"] for r in ranks], initial=ranks[0]["initial"])
    torch.testing.assert_close(ranks[0]["losses"], ref["losses"], rtol=1e-4, atol=1e-5)
    workers.assert_states_close(ranks[0]["state"], ref["state"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "backend", [{"backend": "fsdp2"}, {"backend": "deepspeed", "zero_stage": 3}],
    ids=["fsdp2", "zero3"],
)  # fmt: skip
def test_offload_model_frees_accelerator_memory_and_changes_nothing(
    backend: dict[str, object],
) -> None:
    world = min(2, _gpus())
    cfg = workers.config(device="cuda", train_batch_size=4 * world, **backend)
    plain = run_distributed(workers.offload_model_case, world, cfg, False, init_process_group=False)
    moved = run_distributed(workers.offload_model_case, world, cfg, True, init_process_group=False)
    assert moved[0]["losses"] == plain[0]["losses"]
    workers.assert_states_close(moved[0]["state"], plain[0]["state"], rtol=0, atol=0)
    for before, after in moved[0]["memory"]:
        assert after < before, (before, after)


@pytest.mark.deepspeed
def test_fsdp2_checkpoint_converted_to_a_cuda_deepspeed_run_resumes(tmp_path: Path) -> None:
    """On CUDA the DeepSpeed strategy steps with FusedAdam (int steps, its own group
    keys); a conversion writes torch AdamW's state, which the load adapts
    (``adapt_adam_state``). N FSDP2 steps, convert, M ZeRO-2 steps == N+M FSDP2 steps."""
    import subprocess
    import sys

    world = min(2, _gpus())
    cfg = workers.config(device="cuda", train_batch_size=4 * world, micro_train_batch_size=2)
    ds_cfg = {**cfg, "backend": "deepspeed", "zero_stage": 2}
    run = {"max_steps": 6, "init_process_group": False}
    full = run_distributed(workers.train, world, cfg, 6, **run)
    run_distributed(workers.train, world, cfg, 3, save_dir=str(tmp_path / "a"), **run)
    subprocess.run(
        [sys.executable, "-m", "lightrft.strategy.cli", "ckpt", "convert", str(tmp_path / "a"),
         "--to", "deepspeed", str(tmp_path / "b"), "--zero-stage", "2", "--no-progress"],
        check=True, timeout=600,
    )  # fmt: skip
    resumed = run_distributed(workers.train, world, ds_cfg, 3, load_dir=str(tmp_path / "b"), **run)
    torch.testing.assert_close(resumed[0]["losses"], full[0]["losses"][3:], rtol=1e-4, atol=1e-5)
    workers.assert_states_close(resumed[0]["state"], full[0]["state"], rtol=1e-4, atol=1e-5)


@pytest.mark.deepspeed
def test_zero0_bf16_cuda_checkpoint_is_read_from_the_fused_wrapper(tmp_path: Path) -> None:
    """On CUDA, ZeRO-0 in bf16 steps with FusedAdam inside DeepSpeed's fused FP16
    wrapper (one flat fp32 master per group): the files give back what it held."""
    from lightrft.strategy.checkpoint.tools.offline import open_checkpoint, read_contents

    from . import ds_workers

    _gpus()
    cfg = ds_workers.ds(
        0, device="cuda", precision="bf16", train_batch_size=1, micro_train_batch_size=1
    )
    save_dir = tmp_path / "ckpt"
    (rank0,) = run_distributed(
        ds_workers.mixed_precision_state_case, 1, cfg, str(save_dir), init_process_group=False
    )
    assert rank0["wrapper"] == "FP16_Optimizer"
    contents = read_contents(open_checkpoint(save_dir), optimizer=True)
    assert contents.optimizer is not None
    for name, tensors in rank0["held"].items():
        assert torch.equal(contents.weights[name], tensors["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(contents.optimizer.state[name][key], tensors[key]), (name, key)


def test_packed_rows_with_flash_attention_varlen_keep_samples_apart() -> None:
    """flash-attention's variable-length kernel on a packed row (transformers turns the
    restarting position ids into cu_seqlens): each sample's log-probabilities are its
    padded (SDPA) ones, and changing one sample moves no other."""
    _gpus()
    pytest.importorskip("flash_attn", reason="flash-attn is not installed on this machine")
    from lightrft.strategy.packing import build_batch, token_logprobs
    from lightrft.testing.models import tiny_hf_causal_lm

    samples = [([3, 4, 5], [6, 7, 8, 9, 10]), ([11, 12, 13, 14], list(range(20, 40))),
               ([15, 16], [17]), ([40, 41, 42, 43, 44, 45], list(range(50, 59)))]  # fmt: skip
    torch.manual_seed(0)
    flash = tiny_hf_causal_lm(attn_implementation="flash_attention_2").to("cuda", torch.bfloat16)
    sdpa = tiny_hf_causal_lm(attn_implementation="sdpa").to("cuda", torch.bfloat16)
    sdpa.load_state_dict(flash.state_dict())
    packed = build_batch(samples, range(4), packed=True).to("cuda")
    got, _ = token_logprobs(flash, packed)
    want, _ = token_logprobs(sdpa, build_batch(samples, range(4), packed=False).to("cuda"))
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)  # bf16 kernels differ
    changed = [([99, 98, 97], [96, 95, 94, 93, 92]), *samples[1:]]
    after, _ = token_logprobs(flash, build_batch(changed, range(4), packed=True).to("cuda"))
    for i, (x, y) in enumerate(zip(packed.split(got), packed.split(after), strict=True)):
        if i:
            assert torch.equal(x, y), f"sample {i} saw sample 0's tokens"


def test_weights_reach_an_engine_rank_over_nccl(tmp_path: Path) -> None:
    """engine_placement separate on CUDA: 1 trainer rank and 1 engine rank on their own
    GPUs; the weight buckets go over the channel's NCCL group, device to device, and
    every sync verifies."""
    from lightrft.testing.models import tiny_hf_causal_lm

    from . import engine_rank_workers

    if _gpus() < 2:
        pytest.skip("needs 2 GPUs (a trainer rank and an engine rank)")
    model_dir = tmp_path / "tiny_lm"
    torch.manual_seed(0)
    tiny_hf_causal_lm().save_pretrained(model_dir)
    cfg = engine_rank_workers.separate_config(str(model_dir), device="cuda")
    trainer, engine = run_distributed(
        engine_rank_workers.cuda_channel_case, 2, cfg, str(model_dir),
        init_process_group=False, timeout=300,
    )  # fmt: skip
    assert engine == {"engine_rank_exit": 0}
    assert trainer["channel_device"].startswith("cuda")
    assert trainer["channel_transport"] == "nccl"
    assert trainer["tensors"] > 0
    assert trainer["verified_before"] < 1e-3 and trainer["sync_gap"] < 1e-3
    assert all(len(out) == 4 for out in trainer["generated"])
