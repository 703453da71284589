"""Waiting for torch's gloo worker threads to go idle before the interpreter finalises.

A gloo process group runs each collective on a worker thread (``pt_gloo_runloop``).
The worker signals the collective complete, *then* drops its reference to the work
and its tensors. When Python has already dropped a tensor, that last release frees
the tensor's Python object, which needs the GIL. If the main thread has begun
interpreter finalisation by then, CPython 3.11-3.13 ends the worker with
``pthread_exit``; the unwind passes through gloo's ``noexcept`` work destructor and
the process aborts ("terminate called without an active exception", exit -6). It
takes a loaded machine for the worker to be that late (about 1 launch in 10 with
three jobs on two cores; found with gdb on a core dump).

:func:`wait_until_idle` closes the window: it waits, with the GIL released, until
every worker is asleep and stays asleep, so no release is left for finalisation.
Linux only (it reads ``/proc``); elsewhere it returns at once.
"""

from __future__ import annotations

import time
from pathlib import Path

WORKER_NAME = "pt_gloo_runloop"  # the name torch gives each gloo worker thread


def _worker_activity(tasks: Path) -> tuple[int, bool, int] | None:
    """(workers, every worker asleep, their context switches in all), or None when
    ``/proc`` cannot be read. A thread that exits between listing and reading is
    skipped."""
    workers, asleep, switches = 0, True, 0
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return None
    for thread in threads:
        try:
            if (thread / "comm").read_text().strip() != WORKER_NAME:
                continue
            stat = (thread / "stat").read_text()
            status = (thread / "status").read_text()
        except OSError:
            continue
        workers += 1
        state = stat.rsplit(")", 1)[1].split()[0]
        asleep = asleep and state == "S"
        for line in status.splitlines():
            if "ctxt_switches:" in line:  # voluntary and nonvoluntary
                switches += int(line.split()[-1])
    return workers, asleep, switches


def wait_until_idle(
    timeout: float = 5.0, window: float = 0.01, quiet_windows: int = 2, tasks: Path | None = None
) -> bool:
    """Wait until every gloo worker thread of this process is asleep and stays asleep
    for ``quiet_windows`` consecutive windows of ``window`` seconds (no context
    switch, so none was woken, as a thread waiting for the GIL is when
    ``time.sleep`` releases it). True when idle (or there are no workers), False
    when ``timeout`` passed first or ``/proc`` is unreadable."""
    tasks = tasks or Path("/proc/self/task")
    deadline = time.monotonic() + timeout
    last = _worker_activity(tasks)
    if last is None:
        return False
    if last[0] == 0:
        return True
    quiet = 0
    while quiet < quiet_windows:
        if time.monotonic() > deadline:
            return False
        time.sleep(window)  # releases the GIL: a worker waiting for it runs now
        now = _worker_activity(tasks)
        if now is None:
            return False
        quiet = quiet + 1 if now[1] and last[1] and now[2] == last[2] else 0
        last = now
    return True
