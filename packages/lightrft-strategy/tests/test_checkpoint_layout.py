"""The checkpoint directory protocol, in one process (no process group needed)."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from lightrft.strategy.checkpoint import (
    CheckpointDir,
    CheckpointNotFoundError,
    ForeignCheckpointError,
    IncompleteCheckpointError,
)
from lightrft.strategy.checkpoint.layout import LATEST_FILE, METADATA_FILE
from lightrft.strategy.checkpoint.safe_io import SafeFileSystemReader, check_plain


def save(
    ckpt: CheckpointDir, tag: str, payload: bytes = b"x" * 100, backend: str = "fsdp2"
) -> Path:
    staging = ckpt.begin(tag)
    (staging / "state.bin").write_bytes(payload)
    return ckpt.commit(tag, staging, {"backend": backend, "world_size": 1})


@pytest.fixture
def ckpt(tmp_path: Path) -> CheckpointDir:
    return CheckpointDir(tmp_path / "ckpts", rank=0, barrier=lambda: None)


def test_commit_writes_metadata_last_with_file_sizes_and_latest(ckpt: CheckpointDir) -> None:
    path = save(ckpt, "step1", b"abc")
    meta = json.loads((path / METADATA_FILE).read_text())
    assert meta["files"] == {"state.bin": 3}
    assert meta["backend"] == "fsdp2"
    assert (ckpt.root / LATEST_FILE).read_text().strip() == "step1"
    assert not list(ckpt.root.glob(".*partial"))
    assert ckpt.resolve(None, backend="fsdp2").tag == "step1"


def test_interrupted_save_leaves_previous_checkpoint_and_latest(ckpt: CheckpointDir) -> None:
    save(ckpt, "step1")
    staging = ckpt.begin("step2")
    (staging / "state.bin").write_bytes(b"half")  # ...and the process dies here
    assert (ckpt.root / LATEST_FILE).read_text().strip() == "step1"
    assert ckpt.resolve(None, backend="fsdp2").tag == "step1"
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint 'step2'.*interrupted"):
        ckpt.resolve("step2", backend="fsdp2")
    assert [i.tag for i in ckpt.complete()] == ["step1"]
    save(ckpt, "step2")  # a later save of the same tag clears the stale staging
    assert ckpt.resolve(None, backend="fsdp2").tag == "step2"


def test_saving_an_existing_tag_replaces_it(ckpt: CheckpointDir) -> None:
    save(ckpt, "step1", b"old")
    save(ckpt, "step1", b"newer")
    assert (ckpt.root / "step1" / "state.bin").read_bytes() == b"newer"
    assert [p.name for p in ckpt.root.iterdir() if p.name.startswith(".")] == []


def test_rotation_by_count_deletes_oldest_only_and_never_foreign_dirs(ckpt: CheckpointDir) -> None:
    for i in range(5):
        save(ckpt, f"step{i}")
    (ckpt.root / "tensorboard").mkdir()
    (ckpt.root / "tensorboard" / "events").write_text("user data")
    (ckpt.root / "notes_without_metadata").mkdir()
    deleted = ckpt.rotate(max_num=2, max_mem_gib=1e8, newest="step4")
    assert deleted == ["step0", "step1", "step2"]
    assert sorted(p.name for p in ckpt.root.iterdir()) == [
        LATEST_FILE, "notes_without_metadata", "step3", "step4", "tensorboard",
    ]  # fmt: skip


def test_rotation_by_size_in_gib_keeps_the_newest_even_if_too_big(ckpt: CheckpointDir) -> None:
    for i in range(3):
        save(ckpt, f"step{i}", b"y" * 1000)
    one_and_a_half = 1500 / 2**30
    assert ckpt.rotate(max_num=10, max_mem_gib=one_and_a_half, newest="step2") == ["step0", "step1"]
    assert ckpt.rotate(max_num=10, max_mem_gib=1e-12, newest="step2") == []
    assert [i.tag for i in ckpt.complete()] == ["step2"]


def test_rotation_needs_max_num_of_at_least_one(ckpt: CheckpointDir) -> None:
    save(ckpt, "a")
    with pytest.raises(ValueError, match="max_num=0 must be >= 1"):
        ckpt.rotate(max_num=0, max_mem_gib=1, newest="a")


def test_no_checkpoint(ckpt: CheckpointDir, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint directory"):
        ckpt.resolve(None, backend="fsdp2")
    ckpt.root.mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint in .*no 'latest' file"):
        ckpt.resolve(None, backend="fsdp2")


def test_truncated_file_is_detected(ckpt: CheckpointDir) -> None:
    path = save(ckpt, "step1", b"z" * 64)
    with open(path / "state.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(
        IncompleteCheckpointError, match=r"state.bin has 10 bytes, but 64 were saved"
    ):
        ckpt.resolve(None, backend="fsdp2")


def test_missing_file_and_missing_metadata_are_detected(ckpt: CheckpointDir) -> None:
    path = save(ckpt, "step1")
    (path / "state.bin").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"missing state\.bin"):
        ckpt.resolve(None, backend="fsdp2")
    (path / METADATA_FILE).unlink()
    with pytest.raises(IncompleteCheckpointError, match="save did not finish"):
        ckpt.resolve("step1", backend="fsdp2")


def test_corrupt_metadata_is_detected(ckpt: CheckpointDir) -> None:
    path = save(ckpt, "step1")
    (path / METADATA_FILE).write_text("{not json")
    with pytest.raises(IncompleteCheckpointError, match="unreadable or of an unknown format"):
        ckpt.resolve("step1", backend="fsdp2")


def test_other_backend_is_refused_with_the_fix(ckpt: CheckpointDir) -> None:
    save(ckpt, "step1", backend="deepspeed")
    with pytest.raises(
        ForeignCheckpointError, match=r"saved by the 'deepspeed' backend.*backend='deepspeed'"
    ):
        ckpt.resolve(None, backend="fsdp2")


def test_plain_deepspeed_checkpoint_is_named(ckpt: CheckpointDir) -> None:
    foreign = ckpt.root / "global_step10"
    foreign.mkdir(parents=True)
    (foreign / "mp_rank_00_model_states.pt").write_bytes(b"\0")
    (ckpt.root / LATEST_FILE).write_text("global_step10")
    with pytest.raises(ForeignCheckpointError, match="plain DeepSpeed checkpoint"):
        ckpt.resolve(None, backend="deepspeed")


@pytest.mark.parametrize("tag", ["", "../escape", ".hidden", "a/b", "latest"])
def test_unsafe_tags_are_refused(ckpt: CheckpointDir, tag: str) -> None:
    with pytest.raises(ValueError, match="not a plain directory name"):
        ckpt.begin(tag)


def test_dcp_metadata_reader_refuses_foreign_pickles(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_dcp_metadata_reader_reads_real_metadata(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    target = {"w": torch.zeros(2, 3), "step": 0}
    dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], state["w"])
    assert target["step"] == 3


def test_client_state_must_be_plain() -> None:
    check_plain({"step": 1, "t": torch.ones(2), "nested": [1.5, None, ("a", {"b": True})]})
    with pytest.raises(TypeError, match=r"client_state\['obj'\] is a BytesIO"):
        check_plain({"obj": io.BytesIO()})
