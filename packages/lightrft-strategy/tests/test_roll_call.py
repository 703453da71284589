"""The roll call's logic over an in-memory store: who is named, which errors turn into
CollectiveError, nested operations, and how an exited process is recognised."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from lightrft.strategy.roll_call import CollectiveError, RollCall, _exited, is_peer_failure

TIMEOUT = datetime.timedelta(seconds=5)


def _calls(world: int) -> list[RollCall]:
    store = dist.HashStore()
    return [RollCall(store, rank, world, TIMEOUT) for rank in range(world)]


def test_the_ranks_behind_are_named_with_where_they_were() -> None:
    rank0, rank1, _rank2 = _calls(3)
    for call in (rank0, rank1):
        call.arrive("backward")
    rank0.arrive("optimizer_step")
    assert rank0.absent(2) == {
        1: "last reached backward #1",
        2: "never reached a strategy operation",
    }
    rank1.arrive("optimizer_step")
    assert list(rank0.absent(2)) == [2]


def test_a_peer_failure_becomes_a_collective_error_and_other_errors_pass() -> None:
    rank0, _ = _calls(2)
    with pytest.raises(CollectiveError) as caught, rank0.guard("all_reduce"):
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:1234")
    error = caught.value
    assert (error.operation, error.rank, error.missing) == (
        "all_reduce", 0, {1: "never reached a strategy operation"},
    )  # fmt: skip
    assert str(error).startswith("all_reduce #1 failed on rank 0 of 2: rank 1 never reached")
    assert "The collective timeout is 5 s" in str(error)
    assert "Cause: [pair.cc:561] Connection closed by peer" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    for other in (ValueError("shape mismatch"), RuntimeError("mat1 and mat2 shapes")):
        with pytest.raises(type(other)) as passed, rank0.guard("backward"):
            raise other
        assert passed.value is other


def test_nested_operations_arrive_once_under_the_outer_name() -> None:
    rank0, rank1 = _calls(2)
    outer, inner = rank0.guard("save_ckpt"), rank0.guard("all_gather")
    with pytest.raises(CollectiveError) as caught, outer, inner:
        raise RuntimeError("Timed out waiting 1800000ms for recv operation")
    assert caught.value.operation == "save_ckpt"
    assert rank1._arrival(0) is not None and rank1._arrival(0).operation == "save_ckpt"  # type: ignore[union-attr]
    assert rank0._seq == 1


def test_is_peer_failure_reads_gloo_nccl_and_store_messages() -> None:
    for text in ("Timed out waiting 30000ms", "Connection reset by peer", "Broken pipe",
                 "NCCL error: remote process exited (ncclRemoteError)"):  # fmt: skip
        assert is_peer_failure(RuntimeError(text)), text
    assert not is_peer_failure(RuntimeError("expected scalar type Float"))
    assert not is_peer_failure(KeyError("timed out"))  # not a runtime error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_exited_process_counts_before_its_parent_reaps_it() -> None:
    assert not _exited(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # a zombie until reaped: os.kill(pid, 0) alone would call it alive
        try:
            with open(f"/proc/{child.pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
    assert _exited(child.pid)
    child.wait()
    assert _exited(child.pid)


def test_a_rank_killed_inside_the_operation_is_named_once_its_process_has_ended() -> None:
    """Both ranks reached the save; rank 1's process is still ending when rank 0's
    connection to it drops (CI: a SIGKILLed rank, ZeRO-3 save): the roll call looks again
    until the process has exited, and names it."""
    store = dist.HashStore()
    rank0, rank1 = RollCall(store, 0, 2, TIMEOUT), RollCall(store, 1, 2, TIMEOUT)
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        store.set("host/1", f"{socket.gethostname()} {ending.pid}")
        rank1.arrive("save_ckpt")
        with pytest.raises(CollectiveError) as caught, rank0.guard("save_ckpt"):
            raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:1234")
        assert list(caught.value.missing) == [1]
        assert "has exited" in caught.value.missing[1]
    finally:
        ending.wait()
