"""collective_threads.wait_until_idle: it returns once gloo's worker threads are asleep
and stay asleep, waits while one runs, and gives up at its timeout. The exit it
protects is tested end to end in test_launches (a worker made late on purpose)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lightrft.strategy import collective_threads
from lightrft.strategy.collective_threads import WORKER_NAME, wait_until_idle


def _task(tasks: Path, tid: int, name: str, state: str, switches: int = 7) -> None:
    task = tasks / str(tid)
    task.mkdir(parents=True)
    (task / "comm").write_text(name + "\n")
    (task / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")
    (task / "status").write_text(
        f"Name:\t{name}\nvoluntary_ctxt_switches:\t{switches}\nnonvoluntary_ctxt_switches:\t1\n"
    )


def test_asleep_workers_are_idle_and_other_threads_do_not_count(tmp_path: Path) -> None:
    _task(tmp_path, 1, "python", "R")
    _task(tmp_path, 2, WORKER_NAME, "S")
    _task(tmp_path, 3, WORKER_NAME, "S")
    assert wait_until_idle(timeout=2.0, window=0.001, tasks=tmp_path)


def test_a_running_worker_is_waited_for_until_the_timeout(tmp_path: Path) -> None:
    _task(tmp_path, 2, WORKER_NAME, "R")
    start = time.monotonic()
    assert not wait_until_idle(timeout=0.05, window=0.001, tasks=tmp_path)
    assert time.monotonic() - start >= 0.05


def test_no_workers_returns_at_once_and_no_proc_returns_false(tmp_path: Path) -> None:
    _task(tmp_path, 1, "python", "R")
    start = time.monotonic()
    assert wait_until_idle(timeout=5.0, window=1.0, tasks=tmp_path)
    assert time.monotonic() - start < 0.5
    assert not wait_until_idle(timeout=0.1, tasks=tmp_path / "missing")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_real_thread_is_waited_for_while_it_runs_then_found_idle() -> None:
    """A thread with the gloo worker's name spins for 0.3 s, then blocks on an event."""
    named, release = threading.Event(), threading.Event()

    def worker() -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(WORKER_NAME)
        named.set()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass
        release.wait()

    thread = threading.Thread(target=worker, daemon=True)
    start = time.monotonic()
    thread.start()
    named.wait()
    try:
        assert collective_threads._worker_activity(Path("/proc/self/task")) is not None
        assert wait_until_idle(timeout=10.0)
        assert time.monotonic() - start >= 0.3
    finally:
        release.set()
        thread.join()
