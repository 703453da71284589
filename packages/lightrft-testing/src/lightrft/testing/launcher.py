# size: two launchers (forked functions, torchrun scripts) sharing one failure report
"""Run a function, or a script under torchrun, on several local CPU processes.

`run_distributed` is a debug launcher in the spirit of Accelerate's ``debug_launcher``:
it starts ``world_size`` fresh processes on this machine, joins them in a gloo process
group over loopback, runs a picklable top-level function on each and returns the
per-rank results. The processes come from a multiprocessing "forkserver" that has
imported torch (and DeepSpeed and transformers where installed and no GPU is visible)
once, so a launch does not pay those imports again (about 5 s a launch on 2 cores);
``LIGHTRFT_LAUNCHER_START_METHOD=spawn`` starts each rank from a fresh interpreter.
`run_torchrun` runs a script under ``python -m torch.distributed.run``, one torchrun per
simulated node. Both kill everything they started before they return,
and turn failures into `RankFailure` and hangs into `TimeoutError`.

Importing this module does not import torch: the forkserver imports it when it starts,
the parent when it picks a free port (through :mod:`lightrft.strategy.distributed`) and
to unpickle tensors among the results.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import IO, Any, TypeVar

__all__ = ["RankFailure", "find_free_port", "run_distributed", "run_torchrun"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TERM_GRACE_S = 3.0  # SIGTERM, then this long, then SIGKILL
_TAIL_CHARS = 4000
_ENVIRON_LOCK = threading.Lock()
START_METHOD_ENV = "LIGHTRFT_LAUNCHER_START_METHOD"
# Read by libraries when they are imported (libgomp reads OMP_NUM_THREADS as it loads),
# so the forkserver starts with them; everything else reaches a rank as it starts.
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _preload_modules() -> list[str]:
    """What the forkserver imports once. Where a GPU is visible only torch: DeepSpeed's
    import probes CUDA, and a CUDA driver initialised before a fork is unusable in the
    child."""
    import importlib.util
    from glob import glob

    wanted = ["torch", "torch.distributed"]
    if not glob("/dev/nvidia[0-9]*"):
        wanted += ["transformers", "deepspeed"]
    return [name for name in wanted if importlib.util.find_spec(name.split(".")[0])]


def _context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context ranks start from: a forkserver with torch imported
    where the platform has one, else spawn; ``LIGHTRFT_LAUNCHER_START_METHOD`` overrides."""
    method = os.environ.get(START_METHOD_ENV) or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'forkserver' or 'spawn'")
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    with _patched_environ(_SERVER_ENV):
        ctx.set_forkserver_preload(_preload_modules())
        forkserver.ensure_running()
    return ctx


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it
    before the caller binds it; the window is small). The one implementation is
    :func:`lightrft.strategy.distributed.find_free_port`, imported on the first call:
    importing this module still imports no torch."""
    from lightrft.strategy.distributed import find_free_port as strategy_find_free_port

    return strategy_find_free_port()


class RankFailure(RuntimeError):  # noqa: N818 - the name is part of the API
    """One or more ranks (or torchrun nodes) failed.

    The message names each failing rank and says what happened to it: the rank's full
    traceback text when it raised, its exit code or signal when it died without one.

    Attributes:
        failures: rank (or node) number to a description of its failure.
        unit: ``"rank"`` or ``"node"``.
        total: how many ranks (or nodes) ran, when known.
    """

    def __init__(
        self, failures: Mapping[int, str], unit: str = "rank", total: int | None = None
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.unit = unit
        self.total = total
        names = ", ".join(f"{unit} {i}" for i in self.failures)
        of_total = f" of {total}" if total is not None else ""
        lines = [f"{len(self.failures)}{of_total} {unit}(s) failed: {names}"]
        lines += [f"--- {unit} {i} {text}" for i, text in self.failures.items()]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.unit, self.total))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in this process's environment for the block, then restore it."""
    with _ENVIRON_LOCK:
        saved = {key: os.environ.get(key) for key in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _destroy_process_group_if_initialized() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(
    rank: int,
    world_size: int,
    parent_sys_path: list[str],
    payload: bytes,
    init_process_group: bool,
    pg_timeout_s: float,
    environ: Mapping[str, str],
    conn: Connection,
    crash_file: str,
) -> None:
    """Child entry point: run the pickled call and send back ``("ok"|"error", value)``."""
    # A forked rank has the forkserver's environment: take the parent's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    if "torch" in sys.modules and environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(environ["OMP_NUM_THREADS"]))
    # A rank terminated on timeout prints where every thread was, then exits.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # A rank killed by a fatal signal (SIGSEGV, SIGABRT, ...) leaves its Python stacks
    # in crash_file, which the parent puts in the RankFailure (stderr may be captured).
    crash_log = open(crash_file, "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=crash_log, all_threads=True)
    sys.path[:] = parent_sys_path + [p for p in sys.path if p not in parent_sys_path]
    try:
        fn, args, kwargs = pickle.loads(payload)
        if init_process_group:
            import torch.distributed as dist

            timeout = timedelta(seconds=pg_timeout_s)
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        try:
            result = fn(*args, **kwargs)
        finally:
            _destroy_process_group_if_initialized()
        message = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        message = pickle.dumps(("error", traceback.format_exc()))
    try:
        conn.send_bytes(message)
    finally:
        conn.close()


def _stop_processes(procs: list[BaseProcess]) -> None:
    """SIGTERM the live processes, SIGKILL them after a grace, and reap every one."""
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        logger.warning("terminating %s (pid %s)", proc.name, proc.pid)
        proc.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("killing %s (pid %s)", proc.name, proc.pid)
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join()


def run_distributed(
    fn: Callable[..., T],
    world_size: int = 2,
    *args: Any,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
    init_process_group: bool = True,
    failure_grace: float = 10.0,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes joined by gloo.

    Each child's environment is the parent's with RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a fresh free port per call),
    GLOO_SOCKET_IFNAME=lo and OMP_NUM_THREADS=1, then ``env``, on top; it is in place
    before ``fn`` is unpickled. Modules the forkserver preloaded (torch, and DeepSpeed
    and transformers where installed) have already been imported, with
    OMP_NUM_THREADS=1 and GLOO_SOCKET_IFNAME=lo: a variable those read at import time
    needs ``LIGHTRFT_LAUNCHER_START_METHOD=spawn`` (then the variables are set in the
    parent's own ``os.environ``, under a lock, while each child is started). The
    parent's ``sys.path`` is passed on, so functions defined in test modules can be
    unpickled.

    Args:
        fn: a picklable top-level function.
        world_size: number of ranks (processes).
        *args: positional arguments for ``fn``; must be picklable.
        timeout: seconds for the whole run, start-up included; also the gloo timeout.
        env: extra environment variables for the children, overriding the defaults.
        init_process_group: if True, each child calls
            ``torch.distributed.init_process_group("gloo", ...)`` before ``fn`` and
            destroys the group afterwards even if ``fn`` raised. If False, ``fn`` sets
            up its group; a group still initialised when ``fn`` returns is destroyed.
        failure_grace: seconds the other ranks get to finish after the first rank
            fails (they may hang in a collective) before they are killed.
        **kwargs: keyword arguments for ``fn``; must be picklable.

    Returns:
        Each rank's return value, indexed by rank. Values travel by pickle.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
        TypeError: ``fn`` or its arguments cannot be pickled.
        RankFailure: a rank raised, died, or exited non-zero (after all ranks ended).
        TimeoutError: the run took longer than ``timeout``; names the running ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"run_distributed needs a picklable top-level function and picklable "
            f"arguments; pickling {fn!r} failed: {exc}"
        ) from exc

    port = find_free_port()
    ctx = _context()
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    writers: list[Connection] = []
    crash_dir = tempfile.TemporaryDirectory(prefix="run_distributed-")
    crash_files = [os.path.join(crash_dir.name, f"rank{rank}.crash") for rank in range(world_size)]
    logger.debug("run_distributed: %d ranks, MASTER_PORT=%d", world_size, port)
    common_env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    common_env.update(env or {})
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            writers.append(writer)
            rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), **common_env}
            with _ENVIRON_LOCK:
                environ = {**os.environ, **rank_env}
            proc_args = (rank, world_size, list(sys.path), payload, init_process_group, timeout)
            proc = ctx.Process(
                target=_rank_main,
                args=(*proc_args, environ, writer, crash_files[rank]),
                name=f"run_distributed-rank{rank}",
                daemon=False,
            )
            procs.append(proc)
            with _patched_environ(rank_env):
                proc.start()
            writer.close()  # the child holds its own copy; EOF now means the child is gone
        return _collect(procs, readers, timeout, failure_grace, crash_files)
    finally:
        _stop_processes(procs)
        for conn in readers + writers:
            conn.close()
        for started in procs:
            started.close()
        crash_dir.cleanup()


def _collect(
    procs: list[BaseProcess],
    readers: list[Connection],
    timeout: float,
    failure_grace: float,
    crash_files: list[str],
) -> list[Any]:
    """Wait for every rank's message and exit; raise on failure or timeout."""
    deadline = time.monotonic() + timeout
    messages: dict[int, tuple[str, Any]] = {}
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    pending = {reader: rank for rank, reader in enumerate(readers)}
    first_failure: tuple[float, int] | None = None

    def receive(reader: Connection) -> None:
        rank = pending.pop(reader)
        try:
            messages[rank] = pickle.loads(reader.recv_bytes())
        except EOFError:
            return
        except Exception:
            messages[rank] = (
                "error",
                "sent a result the parent cannot unpickle:\n" + traceback.format_exc(),
            )

    while running or pending:
        now = time.monotonic()
        limit = (
            deadline if first_failure is None else min(deadline, first_failure[0] + failure_grace)
        )
        if now >= limit:
            break
        for obj in wait([*pending, *running], timeout=limit - now):
            if isinstance(obj, int):  # a sentinel: the rank's process ended
                rank = running.pop(obj)
                procs[rank].join()
                if readers[rank] in pending and readers[rank].poll(0):
                    receive(readers[rank])
                pending.pop(readers[rank], None)
            elif isinstance(obj, Connection) and obj in pending:
                receive(obj)
        for rank, proc in enumerate(procs):
            failed = messages.get(rank, ("",))[0] == "error" or proc.exitcode not in (None, 0)
            if failed and first_failure is None:
                first_failure = (time.monotonic(), rank)

    still_running = sorted(running.values())
    timed_out = bool(still_running) and time.monotonic() >= deadline
    _stop_processes(procs)
    failures = _failures(procs, messages, still_running, timed_out, first_failure, failure_grace)
    _add_crash_reports(failures, procs, crash_files)
    if timed_out:
        details = "\n" + str(RankFailure(failures, total=len(procs))) if failures else ""
        raise TimeoutError(
            f"run_distributed timed out after {timeout:g} s; ranks still running: "
            f"{still_running}{details}"
        )
    if failures:
        raise RankFailure(failures, total=len(procs))
    return [messages[rank][1] for rank in range(len(procs))]


def _failures(
    procs: list[BaseProcess],
    messages: Mapping[int, tuple[str, Any]],
    still_running: list[int],
    timed_out: bool,
    first_failure: tuple[float, int] | None,
    failure_grace: float,
) -> dict[int, str]:
    """Rank -> what went wrong with it, for the ranks that failed (a rank still running
    at the timeout is named by the TimeoutError instead)."""
    failures: dict[int, str] = {}
    for rank, proc in enumerate(procs):
        status, value = messages.get(rank, ("", None))
        code = proc.exitcode
        if status == "error":
            then = f" (then {_describe_exit(code)})" if code else ""
            failures[rank] = f"raised{then}:\n{value}"
        elif rank in still_running and timed_out:
            continue  # named by the TimeoutError
        elif rank in still_running and first_failure is not None:
            failures[rank] = (
                f"was still running {failure_grace:g} s after rank {first_failure[1]} failed "
                f"and was stopped ({_describe_exit(code)})"
            )
        elif status != "ok" and rank not in still_running:
            failures[rank] = f"{_describe_exit(code)} without reporting a result (see its stderr)"
        elif status == "ok" and code not in (None, 0):
            failures[rank] = f"returned a result, then {_describe_exit(code)}"
    return failures


def _add_crash_reports(
    failures: dict[int, str], procs: list[BaseProcess], crash_files: list[str]
) -> None:
    """Append to each failed rank that a fatal signal killed the Python stacks
    faulthandler wrote as it died."""
    for rank, (proc, path) in enumerate(zip(procs, crash_files, strict=True)):
        if rank not in failures or proc.exitcode is None or proc.exitcode >= 0:
            continue
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
            if text:
                failures[rank] += (
                    f"\nwhere it was when it died (faulthandler):\n{text[-_TAIL_CHARS:]}"
                )


def _read_all(handle: IO[bytes]) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")


def _stop_sessions(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process's session, SIGKILL it after a grace, and reap the leaders."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # also reaches workers a dead torchrun left
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(_TERM_GRACE_S if sig == signal.SIGTERM else None)


def run_torchrun(
    script: str | os.PathLike[str],
    *script_args: str,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    failure_grace: float = 10.0,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` under torchrun, simulating ``nnodes`` nodes on loopback.

    One ``python -m torch.distributed.run`` per node runs concurrently, each with
    ``--nnodes``, ``--nproc-per-node``, ``--node-rank``, ``--master-addr 127.0.0.1`` and a
    shared free ``--master-port``, in its own session so that it and its workers can be
    killed together. GLOO_SOCKET_IFNAME=lo and OMP_NUM_THREADS=1 are set, then ``env``.

    Args:
        script: the Python script each worker runs.
        *script_args: arguments for the script.
        nnodes: number of simulated nodes (torchrun processes).
        nproc_per_node: workers per node.
        timeout: seconds for the whole run.
        env: extra environment variables, overriding the defaults.
        failure_grace: seconds the other nodes get after one fails before being killed.

    Returns:
        One CompletedProcess per node, indexed by node rank, with text stdout and stderr.

    Raises:
        TimeoutError: the run took longer than ``timeout``; names the nodes still running.
        RankFailure: a node exited non-zero; the message holds each failing node's exit
            status and the last 4000 characters of its stdout and of its stderr.
    """
    run_env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})}
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]
    torchrun += [f"--nproc-per-node={nproc_per_node}", "--master-addr=127.0.0.1"]
    torchrun += [f"--master-port={find_free_port()}"]
    cmds = [[*torchrun, f"--node-rank={n}", os.fspath(script), *script_args] for n in range(nnodes)]
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2 * nnodes)]
        try:
            for node, cmd in enumerate(cmds):
                logger.debug("node %d: %s", node, " ".join(cmd))
                out, err = files[2 * node], files[2 * node + 1]
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=out, stderr=err, env=run_env, start_new_session=True
                    )
                )
            deadline = time.monotonic() + timeout
            failed_at: float | None = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode for p in procs):
                    failed_at = now
                if now >= (
                    deadline if failed_at is None else min(deadline, failed_at + failure_grace)
                ):
                    break
                time.sleep(0.05)
            still_running = [node for node, p in enumerate(procs) if p.poll() is None]
            timed_out = bool(still_running) and time.monotonic() >= deadline
        finally:
            _stop_sessions(procs)
        results = [
            subprocess.CompletedProcess(cmd, p.returncode, _read_all(out), _read_all(err))
            for cmd, p, out, err in zip(cmds, procs, files[::2], files[1::2], strict=True)
        ]

    def report(node: int) -> str:
        res = results[node]
        return (
            f"{_describe_exit(res.returncode)}\nstdout tail:\n{res.stdout[-_TAIL_CHARS:]}"
            f"\nstderr tail:\n{res.stderr[-_TAIL_CHARS:]}"
        )

    if timed_out:
        raise TimeoutError(
            f"run_torchrun timed out after {timeout:g} s; nodes still running: {still_running}\n"
            + "\n".join(f"--- node {node} {report(node)}" for node in range(nnodes))
        )
    failures = {node: report(node) for node, res in enumerate(results) if res.returncode != 0}
    if failures:
        raise RankFailure(failures, unit="node", total=nnodes)
    return results
