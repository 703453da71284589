"""``lightrft ckpt`` with DeepSpeed checkpoints written by 2-rank ZeRO jobs: export to
Hugging Face equal to ``save_model``'s, and conversions between FSDP2 and DeepSpeed
after which the run resumes as if it had never moved (N steps on one backend, convert,
M steps on the other == N+M steps on the first, within the backends' parity tolerance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.strategy.checkpoint.tools.offline import open_checkpoint, read_contents
from lightrft.testing.launcher import run_distributed
from tests import ds_workers, workers
from tests.test_ckpt_cli import hf_weights, logits_of, run_cli

pytestmark = pytest.mark.deepspeed
RUN = {"max_steps": 6, "init_process_group": False, "timeout": 300}
CONFIGS = {
    "fsdp2": workers.config(),
    "zero2": ds_workers.ds(2),
    "zero3": ds_workers.ds(3),
}


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
)
def test_zero_checkpoint_exports_like_save_model(
    stage: int, precision: str, tmp_path: Path
) -> None:
    cfg = ds_workers.ds(stage, train_batch_size=2, micro_train_batch_size=1, precision=precision)
    save_dir, saved_model = tmp_path / "ckpt", tmp_path / "hf"
    run_distributed(
        workers.hf_checkpoint_case, 2, cfg, str(save_dir), str(saved_model),
        init_process_group=False, timeout=300,
    )  # fmt: skip
    out = tmp_path / "exported"
    result = run_cli("ckpt", "export", save_dir, "--to", "hf", out, "--no-progress")
    assert "max abs diff 0" in result.stdout
    expected, exported = hf_weights(saved_model), hf_weights(out)
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    torch.testing.assert_close(logits_of(out), logits_of(saved_model), rtol=0, atol=0)
    info = json.loads(run_cli("ckpt", "info", save_dir, "--json").stdout)
    (tag,) = info["tags"]
    assert (tag["backend"], tag["zero_stage"], tag["world_size"]) == ("deepspeed", stage, 2)


@pytest.mark.parametrize(
    ("stage", "extra", "wrapper"),
    [(0, {}, "FP16_UnfusedOptimizer"), (1, {"grad_accum_dtype": "fp32"}, "BF16_Optimizer")],
    ids=["zero0-bf16", "zero1-bf16-fp32-accumulation"],
)
def test_deepspeed_mixed_precision_wrappers_are_read(
    stage: int, extra: dict[str, Any], wrapper: str, tmp_path: Path
) -> None:
    """In bf16, ZeRO-0 keeps the fp32 masters and Adam state in DeepSpeed's FP16 optimizer
    wrapper, and ZeRO-1 with fp32 gradient accumulation in its BF16 optimizer (files
    ``bf16_zero_pp_rank_*``): read from the files, they equal what DeepSpeed held in
    memory, bit for bit; export writes those masters, and a conversion verifies."""
    cfg = ds_workers.ds(
        stage, train_batch_size=2, micro_train_batch_size=1, precision="bf16", **extra
    )
    save_dir = tmp_path / "ckpt"
    ranks = run_distributed(
        ds_workers.mixed_precision_state_case, 2, cfg, str(save_dir),
        init_process_group=False, timeout=300,
    )  # fmt: skip
    assert ranks[0]["wrapper"] == wrapper
    held = ranks[0]["held"]
    contents = read_contents(open_checkpoint(save_dir), optimizer=True)
    assert contents.optimizer is not None
    for name, tensors in held.items():
        assert torch.equal(contents.weights[name], tensors["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(contents.optimizer.state[name][key], tensors[key]), (name, key)
    tied = contents.info.metadata["model"]["tied"]
    assert tied, "the tiny model ties its embeddings: the alias must be checked"
    for alias, source in tied.items():  # the master, not the module's bf16 alias
        assert torch.equal(contents.weights[alias], held[source]["fp32"]), alias
    run_cli("ckpt", "export", save_dir, "--to", "hf", tmp_path / "hf", "--no-progress")
    exported = hf_weights(tmp_path / "hf")
    for name, tensors in held.items():
        assert torch.equal(exported[name], tensors["fp32"]), name
    result = run_cli("ckpt", "convert", save_dir, "--to", "fsdp2", tmp_path / "fsdp2",
                     "--no-progress")  # fmt: skip
    assert "max abs diff 0" in result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per backend: 6 uninterrupted steps, and 3 steps saved to a save_dir."""
    root = tmp_path_factory.mktemp("runs")
    found: dict[str, Any] = {}
    for name in ("fsdp2", "zero2"):
        full = run_distributed(workers.train, 2, CONFIGS[name], 6, **RUN)
        save_dir = root / name
        run_distributed(workers.train, 2, CONFIGS[name], 3, save_dir=str(save_dir), **RUN)
        found[name] = {"full": full, "save_dir": save_dir}
    return found


@pytest.mark.parametrize(
    ("source", "target"), [("fsdp2", "zero2"), ("zero2", "fsdp2"), ("fsdp2", "zero3")]
)
def test_conversion_resumes_where_the_run_left_off(
    source: str, target: str, runs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / target
    args: list[str | Path] = ["ckpt", "convert", runs[source]["save_dir"], "--no-progress"]
    if target == "fsdp2":
        args += ["--to", "fsdp2", out]
    else:
        args += ["--to", "deepspeed", out, "--zero-stage", target[-1]]
    result = run_cli(*args)
    assert "max abs diff 0" in result.stdout
    meta = json.loads((out / "global_step3" / "lightrft_checkpoint.json").read_text())
    assert meta["converted_from"]["backend"] == ("fsdp2" if source == "fsdp2" else "deepspeed")
    assert meta["has_optimizer"] is True

    resumed = run_distributed(workers.train, 2, CONFIGS[target], 3, load_dir=str(out), **RUN)
    full = runs[source]["full"]
    # the backends agree within rtol 1e-5 / atol 1e-6 (reduction order differs)
    torch.testing.assert_close(resumed[0]["losses"], full[0]["losses"][3:], rtol=1e-5, atol=1e-6)
    workers.assert_states_close(resumed[0]["state"], full[0]["state"], rtol=1e-5, atol=1e-6)
    for rank in range(2):  # the loader resumed mid-epoch at the same sample
        assert resumed[rank]["used"] == full[rank]["used"][-len(resumed[rank]["used"]) :]
    assert resumed[0]["lr"] == full[0]["lr"]


def test_a_corrupt_zero_file_is_refused_and_leaves_no_output(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    import shutil

    source = tmp_path / "zero2"
    shutil.copytree(runs["zero2"]["save_dir"], source)
    optim = next(source.glob("*/zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    optim.write_bytes(b"\0" * optim.stat().st_size)  # same size: only the content is wrong
    out = tmp_path / "out"
    result = run_cli("ckpt", "convert", source, "--to", "fsdp2", out, ok=False)
    assert result.returncode == 1
    assert "cannot read" in result.stderr and optim.name in result.stderr
    assert not out.exists()
    result = run_cli("ckpt", "export", source, "--to", "hf", out, ok=False)
    assert result.returncode == 1 and "records no Hugging Face config" in result.stderr


def test_conversion_to_another_world_size_loads_there(runs: dict[str, Any], tmp_path: Path) -> None:
    """ZeRO files partition state per rank: converted for 1 rank, the checkpoint loads
    into a 1-rank ZeRO-2 run, with the weights of the 2-rank run."""
    out = tmp_path / "one_rank"
    args = ["ckpt", "convert", runs["zero2"]["save_dir"], "--to", "deepspeed", out]
    refused = run_cli(*args, "--zero-stage", "2", "--world-size", "1", ok=False)
    assert refused.returncode == 1 and "--drop rng" in refused.stderr
    run_cli(*args, "--zero-stage", "2", "--world-size", "1", "--drop", "rng", "--no-progress")
    (loaded,) = run_distributed(
        workers.load_full_checkpoint, 1, CONFIGS["zero2"], str(out),
        init_process_group=False, timeout=300,
    )  # fmt: skip
    saved = read_contents(open_checkpoint(runs["zero2"]["save_dir"]), optimizer=False)
    workers.assert_states_close(loaded["state"], saved.weights, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [3])  # ZeRO-2 keeps frozen parameters as ZeRO-3 does
def test_frozen_parameters_are_carried(stage: int, tmp_path: Path) -> None:
    """A frozen block lives outside the optimizer (ZeRO keeps it apart from the flat
    groups); it is carried to DeepSpeed and the run resumes there."""
    run = {**RUN, "model": workers.frozen_regressor}
    cfg = CONFIGS["fsdp2"]
    full = run_distributed(workers.train, 2, cfg, 6, **run)
    run_distributed(workers.train, 2, cfg, 3, save_dir=str(tmp_path / "a"), **run)
    args = ["ckpt", "convert", tmp_path / "a", "--to", "deepspeed", tmp_path / "b"]
    assert "max abs diff 0" in run_cli(*args, "--zero-stage", str(stage)).stdout
    resumed = run_distributed(
        workers.train, 2, CONFIGS[f"zero{stage}"], 3, load_dir=str(tmp_path / "b"), **run
    )
    torch.testing.assert_close(resumed[0]["losses"], full[0]["losses"][3:], rtol=1e-5, atol=1e-6)
    workers.assert_states_close(resumed[0]["state"], full[0]["state"], rtol=1e-5, atol=1e-6)


def test_adam_state_is_adapted_to_the_optimizer_that_loads_it() -> None:
    """torch's Adam keeps ``step`` as a float tensor; DeepSpeed's FusedAdam and CPU Adam
    as an int their kernels take, and read group keys torch's groups lack."""
    from lightrft.strategy.deepspeed.strategy import adapt_adam_state

    class KernelAdam(torch.optim.Optimizer):  # FusedAdam's state contract, without CUDA
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 1e-3, "bias_correction": True, "adam_w_mode": True})

    param = torch.nn.Parameter(torch.zeros(3))
    kernel = KernelAdam([param])
    kernel.load_state_dict(
        {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3)}},
         "param_groups": [{"lr": 5e-3, "params": [0]}]}
    )  # fmt: skip
    adapt_adam_state(kernel)
    assert kernel.state[param]["step"] == 3 and type(kernel.state[param]["step"]) is int
    group = kernel.param_groups[0]
    assert (group["lr"], group["bias_correction"], group["adam_w_mode"]) == (5e-3, True, True)

    adamw = torch.optim.AdamW([param])
    adamw.state[param] = {"step": 3, "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    adapt_adam_state(adamw)
    step = adamw.state[param]["step"]
    assert torch.is_tensor(step) and step.dtype == torch.float32 and float(step) == 3.0
