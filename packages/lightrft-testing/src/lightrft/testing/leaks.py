"""What a test leaves behind: a process group, environment variables, threads.

The ``no_leaks`` fixture of the pytest plugin takes a :func:`snapshot` before a test,
and after it names every leak (:func:`find`), puts the environment and the process
group back (:func:`clean_up`) and fails the test, so the next test starts clean and
the leaking one is the one that fails. Lightning's test suite polices its tests the
same way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ALLOWED_ENV",
    "ALLOWED_THREADS",
    "ALLOWED_THREAD_MODULES",
    "Snapshot",
    "clean_up",
    "find",
    "snapshot",
]

#: Variables libraries set in the process on first use, which no test can avoid:
#: OpenMP's, DeepSpeed's accelerator choice and CUDA check, tokenizers' setting, the
#: Triton and TorchInductor caches (torch's extension builder), what importing vLLM
#: sets (and OpenCV, which it imports, to LD_LIBRARY_PATH), pytest's own.
ALLOWED_ENV = frozenset(
    {
        "KMP_DUPLICATE_LIB_OK",
        "KMP_INIT_AT_FORK",
        "DS_ACCELERATOR",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TOKENIZERS_PARALLELISM",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCHINDUCTOR_COMPILE_THREADS",
        "TRITON_CACHE_AUTOTUNING",
        "TILELANG_CLEANUP_TEMP_FILES",
        "LD_LIBRARY_PATH",
        "PYTEST_CURRENT_TEST",
    }
)
#: Threads libraries keep for the process's life (name prefixes): tqdm's monitor, the
#: stdlib's queue feeder, a debugger's.
ALLOWED_THREADS = ("tqdm_monitor", "TMonitor", "QueueFeederThread", "pydevd")
#: Modules whose threads are kept for the process's life: the stdlib's resource sharer
#: (started when a tensor's file descriptor is pickled, as SGLang's serializer does).
ALLOWED_THREAD_MODULES = ("multiprocessing.resource_sharer",)
_THREAD_GRACE_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    environ: dict[str, str]
    threads: frozenset[int]
    process_group: bool


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def snapshot() -> Snapshot:
    return Snapshot(
        environ=dict(os.environ),
        threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
        process_group=_group_initialized(),
    )


def _new_threads(before: Snapshot, allowed: Iterable[str]) -> list[threading.Thread]:
    prefixes = tuple(allowed)
    deadline = time.monotonic() + _THREAD_GRACE_S
    while True:  # a thread the test stopped may take a moment to end
        new = [
            t
            for t in threading.enumerate()
            if t.ident not in before.threads
            and t.is_alive()
            and not t.name.startswith(prefixes)
            and getattr(getattr(t, "_target", None), "__module__", None)
            not in ALLOWED_THREAD_MODULES
        ]
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.05)


def find(
    before: Snapshot,
    *,
    allowed_env: Iterable[str] = ALLOWED_ENV,
    allowed_threads: Iterable[str] = ALLOWED_THREADS,
) -> list[str]:
    """One line per leak since ``before``: a process group left initialised, each
    environment variable set, changed or removed, each new thread still alive."""
    found: list[str] = []
    if _group_initialized() and not before.process_group:
        found.append(
            "a process group is still initialised (close the strategy, or call "
            "torch.distributed.destroy_process_group())"
        )
    skip = set(allowed_env)
    now = dict(os.environ)
    for key in sorted((now.keys() | before.environ.keys()) - skip):
        old, new = before.environ.get(key), now.get(key)
        if old == new:
            continue
        if old is None:
            found.append(f"environment variable {key}={new!r} was set")
        elif new is None:
            found.append(f"environment variable {key} (was {old!r}) was removed")
        else:
            found.append(f"environment variable {key} changed from {old!r} to {new!r}")
    for thread in _new_threads(before, allowed_threads):
        kind = "daemon thread" if thread.daemon else "thread"
        found.append(f"{kind} {thread.name!r} ({type(thread).__name__}) is still running")
    if found:
        found.append("(monkeypatch.setenv restores variables; stop threads you start)")
    return found


def clean_up(before: Snapshot, *, allowed_env: Iterable[str] = ALLOWED_ENV) -> None:
    """Destroy a process group the test left and put the environment back as it was
    (the allowed variables as they are now)."""
    if _group_initialized() and not before.process_group:
        sys.modules["torch.distributed"].destroy_process_group()
    keep = {key: os.environ[key] for key in allowed_env if key in os.environ}
    os.environ.clear()
    os.environ.update({**before.environ, **keep})
