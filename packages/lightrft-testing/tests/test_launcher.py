"""lightrft.testing.launcher on real processes: gloo over loopback, forkserver and
spawn, torchrun.

The functions the ranks run are defined at the top of this module so that the children
can unpickle them by name (``tests.test_launcher.<name>``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import RankFailure, find_free_port, run_distributed, run_torchrun

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
    "LIGHTRFT_TEST_MARKER",
)
TEARDOWN_GUARD_EXIT = 17


# --- functions run by the ranks ---------------------------------------------------------


def _exit_at_shutdown_if_group_left_initialised() -> None:
    """Make this child exit 17 if a process group is still initialised at shutdown."""
    import atexit

    import torch.distributed as dist

    def check() -> None:
        if dist.is_initialized():
            os._exit(TEARDOWN_GUARD_EXIT)

    atexit.register(check)


def all_reduce_rank(scale: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _exit_at_shutdown_if_group_left_initialised()
    rank = dist.get_rank()
    tensor = torch.tensor([(rank + 1) * scale])
    dist.all_reduce(tensor)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "tensor": tensor,
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "threads": torch.get_num_threads(),
    }


def init_group_itself() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    _exit_at_shutdown_if_group_left_initialised()
    was_initialised = dist.is_initialized()
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    # The group is deliberately left initialised: the launcher must destroy it.
    return {
        "was_initialised": was_initialised,
        "sum": tensor.item(),
        "port": os.environ["MASTER_PORT"],
        "threads": torch.get_num_threads(),
    }


def raise_on_rank_1_after_init() -> None:
    import torch
    import torch.distributed as dist

    _exit_at_shutdown_if_group_left_initialised()
    if dist.get_rank() == 1:
        raise ValueError("rank one exploded after init")
    dist.all_reduce(torch.ones(1))  # fails once rank 1's connection goes away


def rank_1_fails_while_rank_0_waits_in_rendezvous() -> None:
    """Rank 0 blocks in init_process_group, a collective rank 1 never joins."""
    if os.environ["RANK"] == "0":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return
    # Rank 1 waits until rank 0 serves the rendezvous store inside init_process_group
    # (a plain TCP connect, so this rank needs no torch), then fails without joining.
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(address, timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    raise RuntimeError("rank 1 gave up before joining the group")


def sleep_forever() -> None:
    threading.Event().wait()


def die_without_traceback() -> None:
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def crash_in_native_code() -> None:
    """Rank 1 dies by SIGSEGV inside a named function, as a crash in a C extension would."""
    if os.environ["RANK"] == "1":
        segfault_here()


def segfault_here() -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV


# --- helpers ----------------------------------------------------------------------------


def _processes(parent: int | None = None, mentioning: str | None = None) -> list[str]:
    """Describe live or zombie processes that are children of ``parent`` or whose command
    line mentions ``mentioning`` (Linux /proc scan; empty elsewhere)."""
    found: list[str] = []
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if "multiprocessing.resource_tracker" in cmdline:
            continue  # the stdlib's one tracker per parent, started by the first spawn
        if "multiprocessing.forkserver" in cmdline:
            # the stdlib's one forkserver per parent, kept for the next launch: the ranks
            # it forked are its children, so they are checked among them
            if parent is not None and ppid == parent:
                found += _processes(parent=int(entry))
            continue
        if (parent is not None and ppid == parent) or (mentioning and mentioning in cmdline):
            found.append(f"pid {entry} ppid {ppid}: {stat.split()[2]} {cmdline[:200]}")
    return found


@pytest.fixture(autouse=True)
def _no_children_left() -> Iterator[None]:
    yield
    assert multiprocessing.active_children() == []
    assert _processes(parent=os.getpid()) == []


@pytest.fixture(scope="module")
def all_reduce_run() -> list[dict[str, Any]]:
    env = {"LIGHTRFT_TEST_MARKER": "from-the-parent", "OMP_NUM_THREADS": "2"}
    return run_distributed(all_reduce_rank, 2, 10.0, env=env, timeout=120)


@pytest.fixture(scope="module")
def self_init_run() -> list[dict[str, Any]]:
    return run_distributed(init_group_itself, 2, init_process_group=False, timeout=120)


# --- run_distributed --------------------------------------------------------------------


def test_all_reduce_sums_across_ranks_in_rank_order(all_reduce_run: list[dict[str, Any]]) -> None:
    assert [result["rank"] for result in all_reduce_run] == [0, 1]
    for result in all_reduce_run:
        assert result["world_size"] == 2
        assert result["tensor"].tolist() == [30.0]  # 1*10 + 2*10


def test_children_get_rank_env_and_overrides(all_reduce_run: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(all_reduce_run):
        env = result["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["LIGHTRFT_TEST_MARKER"] == "from-the-parent"
        assert env["OMP_NUM_THREADS"] == "2"  # the override beats the default of 1
        assert result["threads"] == 2
    assert all_reduce_run[0]["env"]["MASTER_PORT"] == all_reduce_run[1]["env"]["MASTER_PORT"]
    assert "LIGHTRFT_TEST_MARKER" not in os.environ
    assert os.environ.get("RANK") != "1"


def where_torch_came_from() -> dict[str, Any]:
    import sys

    return {
        "torch_was_imported": "torch" in sys.modules,
        "late": os.environ.get("LIGHTRFT_TEST_LATE"),
        "rank": os.environ["RANK"],
    }


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_parents_environment_as_it_is_now(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forkserver started with an earlier environment; a rank still gets the
    parent's present one, as a spawned rank does. Forked ranks start with torch imported
    (that is the point of the forkserver); spawned ones do not."""
    monkeypatch.setenv("LIGHTRFT_LAUNCHER_START_METHOD", method)
    run_distributed(where_torch_came_from, 1, init_process_group=False, timeout=60)
    monkeypatch.setenv("LIGHTRFT_TEST_LATE", "set-after-the-server-started")
    ranks = run_distributed(where_torch_came_from, 2, init_process_group=False, timeout=60)
    assert [r["late"] for r in ranks] == ["set-after-the-server-started"] * 2
    assert [r["rank"] for r in ranks] == ["0", "1"]
    assert [r["torch_was_imported"] for r in ranks] == [method == "forkserver"] * 2


def test_an_unknown_start_method_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTRFT_LAUNCHER_START_METHOD", "fork")
    with pytest.raises(ValueError, match=r"LIGHTRFT_LAUNCHER_START_METHOD='fork'.*forkserver"):
        run_distributed(where_torch_came_from, 1, init_process_group=False)


def test_init_process_group_false_leaves_init_to_fn(self_init_run: list[dict[str, Any]]) -> None:
    for result in self_init_run:
        assert result["was_initialised"] is False
        assert result["sum"] == 2.0
        assert result["threads"] == 1  # OMP_NUM_THREADS=1 by default
    # The group fn left initialised was destroyed: the atexit guard did not fire (a
    # non-zero exit after a result is a RankFailure).


def test_consecutive_calls_use_fresh_ports(
    all_reduce_run: list[dict[str, Any]], self_init_run: list[dict[str, Any]]
) -> None:
    assert all_reduce_run[0]["env"]["MASTER_PORT"] != self_init_run[0]["port"]


@pytest.mark.timeout(90)
def test_exception_in_rank_1_carries_its_traceback() -> None:
    with pytest.raises(RankFailure) as caught:
        run_distributed(raise_on_rank_1_after_init, 2, timeout=60)
    message = str(caught.value)
    assert "rank 1 raised" in message
    assert "ValueError: rank one exploded after init" in message
    assert "Traceback (most recent call last)" in caught.value.failures[1]
    assert "raise_on_rank_1_after_init" in caught.value.failures[1]
    assert f"code {TEARDOWN_GUARD_EXIT}" not in message  # group destroyed although fn raised


@pytest.mark.timeout(90)
def test_rank_hung_in_collective_is_killed_after_peer_fails() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_distributed(
            rank_1_fails_while_rank_0_waits_in_rendezvous,
            2,
            init_process_group=False,
            failure_grace=1.0,
            timeout=60,
        )
    elapsed = time.monotonic() - start
    failures = caught.value.failures
    assert "RuntimeError: rank 1 gave up before joining the group" in failures[1]
    assert "was still running 1 s after rank 1 failed" in failures[0]
    assert "SIGTERM" in failures[0] or "SIGKILL" in failures[0]
    assert elapsed < 40, elapsed  # not the 60 s timeout


@pytest.mark.timeout(60)
def test_timeout_kills_all_ranks_and_names_them() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after 2 s; ranks still running: \[0, 1\]"):
        run_distributed(sleep_forever, 2, init_process_group=False, timeout=2.0)
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_ranks_dying_without_traceback_report_signal_and_exit_code() -> None:
    with pytest.raises(RankFailure) as caught:
        run_distributed(die_without_traceback, 2, init_process_group=False, timeout=30)
    failures = caught.value.failures
    assert "killed by SIGKILL (exit code -9)" in failures[0]
    assert "exited with code 3" in failures[1]
    assert "rank 0 was killed by SIGKILL" in str(caught.value)


@pytest.mark.timeout(60)
def test_a_rank_killed_by_sigsegv_reports_where_it_was() -> None:
    with pytest.raises(RankFailure) as caught:
        run_distributed(crash_in_native_code, 2, init_process_group=False, timeout=30)
    failures = caught.value.failures
    assert list(failures) == [1]
    assert "killed by SIGSEGV (exit code -11)" in failures[1]
    assert "where it was when it died (faulthandler)" in failures[1]
    assert "Fatal Python error: Segmentation fault" in failures[1]
    assert "in segfault_here" in failures[1] and "in crash_in_native_code" in failures[1]


def test_bad_arguments_rejected_before_spawning() -> None:
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda: None, 2)
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(sleep_forever, 2, threading.Lock())
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(sleep_forever, 0)


def test_rank_failure_round_trips_pickle_and_ports_are_free() -> None:
    error = RankFailure({1: "raised:\nboom"}, total=2)
    clone = pickle.loads(pickle.dumps(error))
    assert str(clone) == str(error) == "1 of 2 rank(s) failed: rank 1\n--- rank 1 raised:\nboom"
    assert clone.failures == {1: "raised:\nboom"}
    assert 0 < find_free_port() < 65536


# --- run_torchrun -----------------------------------------------------------------------

ALL_REDUCE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(tensor)
    print(
        f"{sys.argv[1]} rank={dist.get_rank()} world={dist.get_world_size()} "
        f"sum={tensor.item():g} node={os.environ['GROUP_RANK']} "
        f"ifname={os.environ['GLOO_SOCKET_IFNAME']}",
        flush=True,
    )
    dist.destroy_process_group()
    """
)


@pytest.fixture
def all_reduce_script(tmp_path: Path) -> Path:
    script = tmp_path / "all_reduce_script.py"
    script.write_text(ALL_REDUCE_SCRIPT)
    return script


@pytest.mark.timeout(120)
def test_torchrun_one_node_two_workers(all_reduce_script: Path) -> None:
    (node,) = run_torchrun(all_reduce_script, "hello", nproc_per_node=2, timeout=90)
    assert node.returncode == 0
    for rank in (0, 1):
        assert f"hello rank={rank} world=2 sum=1 node=0 ifname=lo" in node.stdout
    assert _processes(mentioning=str(all_reduce_script)) == []


@pytest.mark.timeout(120)
def test_torchrun_two_simulated_nodes(all_reduce_script: Path) -> None:
    nodes = run_torchrun(all_reduce_script, "hi", nnodes=2, nproc_per_node=1, timeout=90)
    assert [node.returncode for node in nodes] == [0, 0]
    assert "hi rank=0 world=2 sum=1 node=0 ifname=lo" in nodes[0].stdout
    assert "hi rank=1 world=2 sum=1 node=1 ifname=lo" in nodes[1].stdout
    assert _processes(mentioning=str(all_reduce_script)) == []


@pytest.mark.timeout(120)
def test_torchrun_failure_reports_node_and_output_tail(tmp_path: Path) -> None:
    script = tmp_path / "failing_script.py"
    script.write_text(
        "import os, sys\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'worker {rank} says goodbye', flush=True)\n"
        "sys.exit(5 if rank == 1 else 0)\n"
    )
    with pytest.raises(RankFailure) as caught:
        run_torchrun(script, nproc_per_node=2, timeout=90)
    message = str(caught.value)
    assert "node 0 exited with code 1" in message
    assert "worker 1 says goodbye" in message
    assert _processes(mentioning=str(script)) == []


@pytest.mark.timeout(60)
def test_torchrun_timeout_kills_the_whole_session(tmp_path: Path) -> None:
    script = tmp_path / "sleeping_script.py"
    script.write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after 2 s; nodes still running: \[0, 1\]"):
        run_torchrun(script, nnodes=2, nproc_per_node=1, timeout=2.0)
    assert time.monotonic() - start < 15
    assert _processes(mentioning=str(script)) == []
