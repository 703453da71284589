"""Exit while a gloo worker thread has yet to release a finished all_reduce's tensor.

torchrun --nproc-per-node 2 exit_with_late_worker.py [--bare]

Each rank pins itself and its gloo workers to one CPU, gives the workers the idle
scheduling class and keeps the GIL (a huge switch interval), so after the all_reduce
completes its worker runs again only when the main thread blocks. An object that
sleeps when module teardown frees it makes the main thread block during interpreter
finalisation: without lightrft's exit wait (``--bare``) the worker then frees the
tensor, needs the GIL, is ended by CPython, and the rank aborts ("terminate called
without an active exception", exit -6; 10 of 10 launches on a 2-core machine). With
``lightrft.strategy`` imported, its exit handler waits for the worker first.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

if "--bare" not in sys.argv:
    import lightrft.strategy.base  # noqa: F401  registers the exit handler


class SleepsAtTeardown:
    def __del__(self) -> None:
        time.sleep(0.5)


dist.init_process_group("gloo")
cpu = {int(os.environ["RANK"]) % (os.cpu_count() or 1)}
sys.setswitchinterval(1000.0)
os.sched_setaffinity(0, cpu)
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as comm:
        if comm.read().strip() == "pt_gloo_runloop":
            os.sched_setaffinity(int(task), cpu)
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
late = SleepsAtTeardown()
tensor = torch.ones(1000)
dist.all_reduce(tensor)
del tensor
