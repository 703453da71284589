"""vLLM's CPU shared-memory segments: what a dead run left is removed, what a live
process maps is kept and named (real files and a real mapping process; no vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightrft.engines import vllm_shm

# maps the file named on the command line, says so, then waits for stdin to close
HOLDER = """
import mmap, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
print("mapped", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path):  # type: ignore[no-untyped-def]
    live = tmp_path / "-tp:0-[0-1]-cpushm_1"
    live.write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
    yield live, proc.pid
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_stale_segments_go_and_live_ones_stay(tmp_path: Path, holder: tuple[Path, int]) -> None:
    live, pid = holder
    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    stale.write_bytes(b"\0" * 4096)
    other = tmp_path / "not-a-vllm-segment"
    other.write_bytes(b"x")
    assert vllm_shm.segments_in_use(tmp_path) == {live.name: [pid]}
    assert vllm_shm.remove_stale_segments(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
    assert vllm_shm.remove_stale_segments(tmp_path) == []


def test_a_start_failure_names_the_segment_in_use_and_its_process(
    tmp_path: Path, holder: tuple[Path, int]
) -> None:
    live, pid = holder
    error = RuntimeError("create shm in SHMManager failed. errno: 17")
    message = vllm_shm.explain_start_failure(error, tmp_path)
    assert message is not None
    assert f"{live} (pid {pid})" in message and "cannot start on one machine" in message
    assert vllm_shm.explain_start_failure(RuntimeError("out of memory"), tmp_path) is None


def test_own_segment_names_are_the_group_name_and_the_rank() -> None:
    # that this is vLLM's naming is checked for real by the TP=2 vLLM test (engines(vllm)):
    # the ranks end with os._exit and no segment is left behind
    group = SimpleNamespace(
        device_communicator=SimpleNamespace(
            rank=1, dist_module=SimpleNamespace(group_name="//-tp:0-[0-1]-cpushm")
        )
    )
    no_shm = SimpleNamespace(device_communicator=SimpleNamespace(rank=0, dist_module=object()))
    assert vllm_shm._own_segment_names([group, no_shm, None]) == ["//-tp:0-[0-1]-cpushm_1"]
