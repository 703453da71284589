"""FSDP2 on 2 real gloo ranks: collectives, EMA, HF export, checkpoint rotation and
saves killed half-way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightrft.strategy.checkpoint.layout import LATEST_FILE, METADATA_FILE
from lightrft.testing.launcher import RankFailure, run_distributed

from . import workers

pytestmark = pytest.mark.timeout(300)


def test_collectives_keep_types_and_shapes() -> None:
    r0, r1 = run_distributed(workers.collectives_case, 2, init_process_group=False)
    assert r0["mean_int"] == 1.5 and isinstance(r0["mean_int"], float)
    assert r0["sum_int"] == 3 and isinstance(r0["sum_int"], int)
    assert r1["max_float"] == 2.5
    assert r0["min_tensor"].tolist() == [0, 9] and r0["min_tensor"].dtype == torch.int64
    assert r1["mean_tensor"].tolist() == [1.5, 4.5]
    assert r0["dict"]["loss"] == 1.0 and r0["dict"]["n"].item() == 3.0
    assert r1["gather_uneven"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert r0["gather_scalar"] == [0, 10]
    assert r0["gather_dict"]["r"].tolist() == [0, 1]
    assert r0["min_uint8"].tolist() == [0, 5] and r0["min_uint8"].dtype == torch.uint8
    assert r1["gather_0d"].tolist() == [0.0, 1.0]
    assert r0["dict_order"] == {"a": 3.0, "b": 30.0} == r1["dict_order"]
    assert r0["numbers"] == {"kl": 1e-3, "loss": 1.0, "tokens": 15.0, "z": -1.0} == r1["numbers"]
    assert r0["numbers_max"] == {"kl": 1e-3, "loss": 1.5, "tokens": 20, "z": -1.0}
    assert isinstance(r0["numbers_max"]["tokens"], int)
    assert r0["number_collectives"] == 2  # one per dict, not one per key


def test_ema_of_sharded_model_equals_ema_on_full_tensors() -> None:
    result = run_distributed(workers.ema_case, 2, init_process_group=False)[0]
    workers.assert_states_close(result["sharded"], result["expected"], rtol=1e-6, atol=1e-7)
    workers.assert_states_close(result["plain"], result["expected"], rtol=1e-6, atol=1e-7)


def test_save_model_writes_hf_safetensors_that_reload_identically(tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "hf"
    ranks = run_distributed(workers.save_model_case, 2, str(out), init_process_group=False)
    assert ranks[0]["stepped"] is True
    assert any(name.startswith("FSDP") for name in ranks[0]["wrapped"])
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=torch.arange(16).reshape(1, 16) % 128).logits
    torch.testing.assert_close(logits, ranks[0]["logits"], rtol=1e-5, atol=1e-5)


def test_rotation_keeps_the_newest_and_latest_names_it(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("not a checkpoint")
    tags = run_distributed(workers.rotation_case, 2, str(tmp_path), 4, 2, init_process_group=False)[
        0
    ]
    assert tags == ["global_step1", "global_step2", "global_step3", "global_step4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step3", "global_step4", LATEST_FILE, "notes",
    ]  # fmt: skip
    assert (tmp_path / LATEST_FILE).read_text().strip() == "global_step4"
    meta = json.loads((tmp_path / "global_step4" / METADATA_FILE).read_text())
    assert (meta["backend"], meta["world_size"], meta["global_step"]) == ("fsdp2", 2, 4)


@pytest.mark.parametrize("kill_in", ["backend_state", "commit"])
def test_save_killed_half_way_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, kill_in: str
) -> None:
    with pytest.raises(RankFailure, match="SIGKILL"):
        run_distributed(
            workers.killed_save_case, 1, str(tmp_path), kill_in, init_process_group=False
        )
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step1"
    assert (tmp_path / ".step2.partial").is_dir()
    loaded = run_distributed(workers.load_full_checkpoint, 1, workers.config(), str(tmp_path),
                             init_process_group=False)  # fmt: skip
    assert loaded[0]["path"].endswith("step1")


def test_a_rank0_failure_while_saving_raises_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_distributed(
        workers.rank0_fails_while_saving_case, 2, str(tmp_path), init_process_group=False,
        timeout=200,
    )  # fmt: skip
    assert outcomes[0] == "OSError: disk full (simulated)"
    assert outcomes[1].startswith("CheckpointError: rank 0 failed writing checkpoint 'bad'")
    assert (tmp_path / LATEST_FILE).read_text().strip() == "good"


@pytest.mark.parametrize("prepared", [True, False], ids=["sharded", "plain"])
def test_load_model_reads_full_weights_and_refuses_bad_files_unchanged(
    tmp_path: Path, prepared: bool
) -> None:
    torch.manual_seed(5)
    source = workers.TinyRegressor()
    weights = tmp_path / "weights.pt"
    torch.save(source.state_dict(), weights)
    ranks = run_distributed(
        workers.load_model_case, 2, workers.config(), str(weights), prepared,
        init_process_group=False,
    )  # fmt: skip
    expected = source.state_dict()
    r0 = ranks[0]
    assert any(not torch.equal(r0["before"][k], v) for k, v in expected.items())
    workers.assert_states_close(r0["untouched"], r0["before"], rtol=0, atol=0)
    workers.assert_states_close(r0["loaded"], expected, rtol=0, atol=0)
    with torch.no_grad():
        want = source(torch.linspace(-1, 1, 2 * workers.DIM).reshape(2, workers.DIM))
    for result in ranks:
        torch.testing.assert_close(result["output"], want, rtol=1e-6, atol=1e-6)
        errors = result["errors"]
        assert errors["strict_partial"].startswith("CheckpointError")
        assert "partial.pt" in errors["strict_partial"] and "head.bias" in errors["strict_partial"]
        assert "strict=False" in errors["strict_partial"]
        assert "renamed.pt" in errors["renamed"] and "key_replace_fn" in errors["renamed"]
        assert "model.head.bias" in errors["renamed"] or "model." in errors["renamed"]
        assert errors["corrupt"].startswith("CheckpointError") and "corrupt.pt" in errors["corrupt"]
        assert (
            errors["missing"].startswith("FileNotFoundError") and "absent.pt" in errors["missing"]
        )


def test_prepare_model_takes_upstream_shard_size_and_reshard_arguments() -> None:
    ranks = run_distributed(workers.layout_case, 2, workers.config(), init_process_group=False)
    layouts = ranks[0]["layouts"]
    head = (4, workers.DIM)
    assert layouts["default"]["mesh"] == (2,) and layouts["default"]["local"] == (2, workers.DIM)
    assert layouts["every_rank"] == layouts["capped"] == layouts["default"]
    # shard groups of one rank: replicated, every rank holds the whole tensor
    assert layouts["replicated"]["mesh"] == (2, 1) and layouts["replicated"]["local"] == head
    # sharded: one FSDP group per block and the root; replicated: nothing to shard, so
    # one group at the root (one gradient all-reduce per step, not one per block)
    assert layouts["default"]["fsdp_groups"] == 3 + 1  # TinyRegressor's 3 blocks
    assert layouts["replicated"]["fsdp_groups"] == 1
    assert layouts["auto"] == layouts["replicated"]  # under 10 B parameters, as upstream
    assert layouts["auto_training"]["mesh"] == (2,)  # trained models shard over every rank
    assert layouts["default"]["block_sharded_after_forward"] is True
    assert layouts["keep_gathered"]["block_sharded_after_forward"] is False
    errors = ranks[1]["errors"]
    assert set(errors) == {"0", "-2", "half"}  # sizes above the world are capped to it
    assert "shard_size=0 is not a shard group size" in errors["0"] and "-1" in errors["0"]
    assert "shard_size=-2" in errors["-2"] and "shard_size='half'" in errors["half"]
    assert ranks[1]["none"] is None
