"""Where this process sits in the job, and the process group that joins it to the rest.

Reads what torchrun or SLURM put in the environment; with neither, the process is a
world of one and gets a loopback address and a free port. Nothing here assumes a
number of GPUs per node or a fixed port.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # re-exported from torch._C
    PrefixStore,
    Store,
    TCPStore,
)

from lightrft.config import ConfigError, ConfigProblem

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(
            [ConfigProblem(name, environ[name], "environment variable must be an integer")],
            subject="launch environment",
        ) from None


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout of this process, as the launcher described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: Literal["torchrun", "slurm", "single"]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """torchrun's RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT first, then
        SLURM's SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, else a single process."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            world = _int(env, "WORLD_SIZE")
            return cls._checked(
                rank=_int(env, "RANK"),
                local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                world_size=world,
                local_world_size=(
                    _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
                ),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 0,
                launcher="torchrun",
            )
        # Only an srun step sets SLURM_STEP_NUM_TASKS; a plain `python` in the batch script
        # sees SLURM_PROCID/SLURM_NTASKS too, but is a single process.
        if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
            if "MASTER_PORT" not in env:
                raise ConfigError(
                    [
                        ConfigProblem(
                            "MASTER_PORT",
                            None,
                            "SLURM sets no rendezvous port; export MASTER_PORT (and "
                            "MASTER_ADDR, the first node's address) in the batch script",
                        )
                    ],
                    subject="launch environment",
                )
            return cls._checked(
                rank=_int(env, "SLURM_PROCID"),
                local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                world_size=_int(env, "SLURM_STEP_NUM_TASKS"),
                local_world_size=(
                    _int(env, "SLURM_NTASKS_PER_NODE")
                    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit()
                    else 1
                ),
                master_addr=env.get("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "")),
                master_port=_int(env, "MASTER_PORT"),
                launcher="slurm",
            )
        return cls(0, 0, 1, 1, "127.0.0.1", 0, "single")

    @classmethod
    def _checked(cls, **values: object) -> LaunchEnv:
        launch = cls(**values)  # type: ignore[arg-type]
        if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
            raise ConfigError(
                [
                    ConfigProblem(
                        "RANK",
                        launch.rank,
                        f"must lie in [0, WORLD_SIZE={launch.world_size}) "
                        f"(launcher {launch.launcher})",
                    )
                ],
                subject="launch environment",
            )
        if launch.launcher == "slurm" and not launch.master_addr:
            raise ConfigError(
                [ConfigProblem("MASTER_ADDR", None, "export the first node's address")],
                subject="launch environment",
            )
        return launch


def resolve_device(choice: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without CUDA is an error."""
    if choice == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise ConfigError(
            [
                ConfigProblem(
                    "device", "cuda", "CUDA is not available here", accepted="'auto' or 'cpu'"
                )
            ]
        )
    return torch.device("cuda") if has_cuda else torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """gloo for CPU tensors; on CUDA also NCCL for CUDA tensors (CPU ones keep gloo)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


_job_stores: dict[tuple[str, int], Store] = {}
_generation = 0
_store: Store | None = None


def _agent_serves(host: str, port: int) -> bool:
    """Whether torchrun's agent hosts the store at ``host:port`` (then no rank does)."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )


def generation_store(launch: LaunchEnv, port: int, timeout: datetime.timedelta) -> Store:
    """The store of this process group's generation: the job's rendezvous store under a
    prefix that is new for every group this process creates.

    The job's store (torchrun's agent's, or one rank 0 hosts) is made once per process
    and kept: closing a strategy never tears it down, so a rank that builds its next
    strategy before another rank has finished closing the last one reaches a live store,
    and the new prefix keeps the last group's keys (gloo's peer addresses) out of the
    new group's rendezvous. Every rank counts its groups the same way, so the prefixes
    agree. A world of one gets a private store.
    """
    global _generation
    host = launch.master_addr
    if launch.launcher == "single":
        job_store: Store = TCPStore(
            host, port, None, True, timeout, wait_for_workers=False, multi_tenant=True
        )
    else:
        cached = _job_stores.get((host, port))
        if cached is not None:
            job_store = cached
        else:
            job_store = TCPStore(
                host,
                port,
                None,
                launch.rank == 0 and not _agent_serves(host, port),
                timeout,
                wait_for_workers=False,
                multi_tenant=True,
            )
            _job_stores[(host, port)] = job_store
    _generation += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"lightrft/{restart}/{_generation}/", job_store)


def forget_group() -> None:
    """Forget the store of the process group this module created (it was destroyed);
    the job's store stays for the next group."""
    global _store
    _store = None


def release_job_stores() -> None:
    """Drop the job stores this process made (rank 0's server stops): at exit only, as
    a later strategy of the job would need them."""
    _job_stores.clear()
    forget_group()


def collective_timeout() -> datetime.timedelta:
    """The process group's timeout, as its backend reports it (torch's default when
    there is no group or it cannot be read)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return DEFAULT_TIMEOUT
    return timeout if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT


def group_store(prefix: str) -> Store | None:
    """The store of the process group this module created last, under ``prefix``
    (None if none)."""
    return None if _store is None else PrefixStore(prefix, _store)


def new_group(ranks: list[int], backend: str | None = None) -> Any:
    """``dist.new_group`` with the process group's timeout: torch gives a new group its
    own default (30 minutes), not the timeout the default group was created with."""
    return dist.new_group(ranks, timeout=collective_timeout(), backend=backend)


def init_process_group(
    launch: LaunchEnv,
    device: torch.device,
    timeout: datetime.timedelta | None = None,
    role: tuple[str, int, int] | None = None,
) -> bool:
    """Join (or create) the default process group. Returns whether this call created it.

    ``role``: ``(name, rank, size)`` when the job's ranks split into roles (trainers and
    engine ranks, ``engine_placement: separate``): the default group is then the
    role's ranks only, under a store prefix of its own; the job's store is still the
    one the launcher describes (``launch``)."""
    global _store
    if device.type == "cuda":
        torch.cuda.set_device(launch.local_rank % max(1, torch.cuda.device_count()))
    name, rank, size = role or ("", launch.rank, launch.world_size)
    if dist.is_initialized():
        if dist.get_world_size() != size:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} already exists, but "
                f"the launcher ({launch.launcher}) says WORLD_SIZE={launch.world_size}"
                + (f", of which {size} are {name}" if role else "")
            )
        return False
    if launch.launcher == "single":
        # a private port, not written to os.environ: child processes (a test's
        # subprocesses, a launcher) must not inherit a port this process holds
        port = find_free_port(launch.master_addr)
    else:
        port = launch.master_port or find_free_port()
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(port))
    timeout = timeout or DEFAULT_TIMEOUT
    store = generation_store(launch, port, timeout)
    dist.init_process_group(
        backend=process_group_backend(device),
        store=PrefixStore(f"pg{name}", store),
        rank=rank,
        world_size=size,
        timeout=timeout,
    )
    _store = store
    logger.debug(
        "rank %d/%d joined %s group via %s",
        launch.rank,
        launch.world_size,
        process_group_backend(device),
        launch.launcher,
    )
    return True
