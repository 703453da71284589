"""save_ckpt / load_ckpt in one process: a mismatched model named, the optimizer and
client state held, a fresh optimizer before the first step, module-only loads, loaders
created after a load, rotation around `latest`, foreign directories and a tokenizer
without save_pretrained refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightrft.strategy import StrategyBase

from . import workers


def test_loading_a_checkpoint_into_another_model_names_the_mismatch(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    from lightrft.strategy import CheckpointError

    small = fsdp2.prepare_model(workers.TinyRegressor(blocks=2), is_training=True)
    fsdp2.save_ckpt(small, tmp_path, tag="small", optimizer=fsdp2.create_optimizer(small))
    bigger = fsdp2.prepare_model(workers.TinyRegressor(blocks=3), is_training=True)
    with pytest.raises(CheckpointError, match=r"does not fit this model.*layers\.2"):
        fsdp2.load_ckpt(bigger, tmp_path, load_optimizer_states=False)


def test_a_load_that_fails_on_the_model_leaves_the_loaders_where_they_were(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    """The model's load fails after the loader states were read: the loaders keep their
    own positions, and a loader made later does not resume from the checkpoint's."""
    from lightrft.strategy import CheckpointError

    small = fsdp2.prepare_model(workers.TinyRegressor(blocks=2), is_training=True)
    fsdp2.create_optimizer(small)
    loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    fsdp2.save_ckpt(small, tmp_path, tag="small")  # the loader at 6 samples
    next(batches)
    bigger = fsdp2.prepare_model(workers.TinyRegressor(blocks=3), is_training=True)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        fsdp2.load_ckpt(bigger, tmp_path, load_optimizer_states=False)
    assert loader.state_dict()["consumed_samples"] == 8
    del loader, batches
    with pytest.raises(CheckpointError, match="does not fit this model"):
        fsdp2.load_ckpt(bigger, tmp_path, load_optimizer_states=False)
    late = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    assert late.state_dict()["consumed_samples"] == 0


def test_a_missing_rng_file_is_named_as_such_not_as_another_world_size(
    fsdp2: StrategyBase, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fsdp2.create_optimizer(model)
    fsdp2.save_ckpt(model, tmp_path, tag="t")
    # as `lightrft ckpt convert --drop rng` leaves it: no RNG file, none listed
    (tmp_path / "t" / "rng" / "rank0.pt").unlink()
    meta_file = tmp_path / "t" / "lightrft_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("rng/")}
    meta_file.write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="lightrft.strategy.checkpoint.manager"):
        fsdp2.load_ckpt(model, tmp_path)
    assert "holds no RNG state for rank 0 (rng/rank0.pt is missing)" in caplog.text
    assert "world size" not in caplog.text


def test_checkpoint_holds_optimizer_from_create_optimizer_and_client_state(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    sched = fsdp2.create_scheduler(optim, 10)
    assert fsdp2.optimizer_of(model) == (optim, sched)
    for _ in range(4):
        workers.grads_step(fsdp2, model, optim, 1.0)
    fsdp2.save_ckpt(model, tmp_path, client_state={"episode": 7, "t": torch.arange(3)})
    meta = json.loads((tmp_path / "global_step1" / "lightrft_checkpoint.json").read_text())
    assert meta["has_optimizer"] and meta["has_scheduler"]
    _, client = fsdp2.load_ckpt(model, tmp_path)
    assert client["episode"] == 7 and client["t"].tolist() == [0, 1, 2]


def test_saving_before_the_first_step_leaves_the_optimizer_fresh(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    fsdp2.save_ckpt(model, tmp_path, tag="init")
    assert not optim.state  # torch's state-dict helper would have stepped it
    fsdp2.load_ckpt(model, tmp_path)
    assert not optim.state


def test_load_module_only_restores_weights_and_nothing_else(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
        workers.grads_step(fsdp2, model, optim, 1.0)
    fsdp2.save_ckpt(model, tmp_path)
    saved = fsdp2.full_state_dict(model)

    fresh = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fresh_optim = fsdp2.create_optimizer(fresh)
    fresh_loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    fsdp2.load_ckpt(fresh, tmp_path, load_module_only=True)
    workers.assert_states_close(fsdp2.full_state_dict(fresh), saved, rtol=0, atol=0)
    assert fresh_loader.state_dict()["consumed_samples"] == 0
    assert fsdp2.step_state(fresh).global_steps == 0
    assert not fresh_optim.state


def test_a_loader_created_after_loading_resumes_too(fsdp2: StrategyBase, tmp_path: Path) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fsdp2.create_optimizer(model)
    loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    fsdp2.save_ckpt(model, tmp_path, tag="t")
    del loader, batches
    fsdp2.load_ckpt(model, tmp_path)
    late = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    assert late.state_dict()["consumed_samples"] == 6


def test_a_planned_step_of_another_length_saved_and_loaded_plans_the_next(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    """A planned step of 3 micro-batches where the config accumulates 4 (a packed or
    token-budget step): saved after its optimizer step and loaded, no accumulation is
    under way, so the next step plans (the resume of a packed RL run)."""
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    assert fsdp2.accumulated_gradient == 4
    plan = fsdp2.plan_micro_batches([3] * 6)  # 3 micro-batches of 2
    with plan:
        stepped = []
        for _ in plan.micro_batches:
            fsdp2.backward(model(torch.ones(2, workers.DIM)).sum(), model, optim)
            stepped.append(fsdp2.optimizer_step(optim, model))
    assert stepped == [False, False, True]
    fsdp2.save_ckpt(model, tmp_path, tag="t")
    fsdp2.load_ckpt(model, tmp_path)
    assert fsdp2.plan_micro_batches([3] * 6).num_micro_batches == 3


def test_rotation_never_deletes_the_checkpoint_latest_names(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fsdp2.create_optimizer(model)
    fsdp2.save_ckpt(model, tmp_path, tag="step1")
    fsdp2.save_ckpt(model, tmp_path, tag="best", save_latest=False, max_num=1)
    assert (tmp_path / "latest").read_text().strip() == "step1"
    assert fsdp2.load_ckpt(model, tmp_path)[0].endswith("step1")


def test_save_refuses_a_foreign_directory_bad_max_num_and_a_bad_tokenizer(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    from lightrft.strategy import CheckpointError

    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_bytes(b"an export")
    with pytest.raises(CheckpointError, match="is not a LightRFT checkpoint"):
        fsdp2.save_ckpt(model, tmp_path, tag="final")
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == b"an export"
    with pytest.raises(ValueError, match="max_num=0 must be >= 1"):
        fsdp2.save_ckpt(model, tmp_path, max_num=0)
    with pytest.raises(TypeError, match=r"tokenizer='tok/' \(str\) has no save_pretrained"):
        fsdp2.save_ckpt(model, tmp_path, tokenizer="tok/")  # a path, not the tokenizer
    assert not (tmp_path / "global_step0").exists()
