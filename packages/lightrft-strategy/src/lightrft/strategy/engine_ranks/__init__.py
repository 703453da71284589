"""Rollout engines on ranks of their own (``engine_placement: separate``).

One ``torchrun`` job holds both roles: its first ranks train, its last
``engine_ranks`` serve engines. The strategy splits them when it joins the job
(``setup_distributed``, so inside ``get_strategy``):

* **trainer ranks**: their default process group is the trainer ranks only, so the
  backend's groups (the FSDP2 mesh, DeepSpeed's groups), sequence-parallel groups and
  every collective of training stay among them, and training code runs unchanged. The
  engine is a :class:`~lightrft.strategy.engine_ranks.remote.RemoteEngine`, set up by
  ``setup_inference_engine`` as any engine (the engine ranks build theirs from the
  config it sends), so ``gather_and_generate``, ``update_engine_weights`` and
  ``verify_engine_weights`` keep their calls;
* **engine ranks**: ``get_strategy()`` does not return on them. They serve
  (:mod:`.serve`) until the trainers close their strategy, then the process exits with
  status 0, so a script written for colocated engines needs no change of code (its
  settings: ``engine_placement: separate``, and no engine sleep).

Trainer rank 0 and the engine ranks share a gloo channel (:mod:`.channel`) for
prompts, outputs and weight buckets (on CUDA the buckets go over NCCL).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from lightrft.strategy import distributed, roll_call
from lightrft.strategy.engine_ranks.channel import Channel
from lightrft.strategy.engine_ranks.remote import EngineRankError, RemoteEngine
from lightrft.strategy.engine_ranks.role import Role
from lightrft.strategy.engine_ranks.serve import Server

if TYPE_CHECKING:
    from lightrft.strategy.world import World

__all__ = ["EngineRankError", "EngineRanks", "RemoteEngine", "Role", "serve"]

logger = logging.getLogger("lightrft.strategy.engine_ranks")

#: How long an engine rank waits for the trainers' next request: as long as training
#: between two rollouts takes (a lost trainer rank 0 ends the wait at once).
_IDLE = datetime.timedelta(days=7)


def _trainer_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """Trainer rank 0 gives up on an engine rank a little before the other trainer
    ranks give up on it, so that it can tell them which engine rank it was."""
    return timeout - min(datetime.timedelta(seconds=10), timeout * 0.1)


class EngineRanks:
    """The trainer ranks' side: the remote engine, and telling the engine ranks to
    exit when the strategy closes (trainer rank 0 speaks for all)."""

    def __init__(
        self,
        role: Role,
        world: World,
        timeout: datetime.timedelta,
        device: torch.device | None = None,
    ) -> None:
        self.role = role
        channel = (
            Channel(0, 1 + role.engines, _trainer_timeout(timeout), device)
            if role.channel_rank == 0
            else None
        )
        self.remote = RemoteEngine(world, channel, role.engine_job_ranks, role.tp)

    def close(self) -> None:
        """Tell every engine rank to shut its engine down and exit (trainer rank 0; no
        collective). An engine rank already gone is logged, not raised."""
        channel = self.remote.channel
        if channel is None:  # another trainer rank, or closed already
            return
        try:  # a generation submitted and never collected answers first
            self.remote.drop_in_flight()
        except RuntimeError as exc:
            logger.warning("a submitted generation was not read back at close: %s", exc)
        self.remote.channel = None
        for to in range(1, channel.size):
            try:
                channel.send(("close",), to)
                channel.receive(to)
            except RuntimeError as exc:
                logger.warning(
                    "engine rank %d did not take the close: %s",
                    self.role.engine_job_ranks[to - 1],
                    exc,
                )


def serve(role: Role, device: torch.device | None = None) -> NoReturn:
    """An engine rank's life: serve the trainers until they close, then exit 0 (1
    when trainer rank 0 is gone without closing)."""
    store = distributed.group_store("engine-hosts/")
    if store is not None:
        store.set(str(role.job.rank), f"{socket.gethostname()} {os.getpid()}")
    channel = Channel(role.channel_rank or 1, 1 + role.engines, _IDLE, device)
    server = Server(channel)
    code = 0
    try:
        server.serve()
    except RuntimeError as exc:
        if not roll_call.is_peer_failure(exc):
            raise
        logger.error("engine rank %d: trainer rank 0 is gone (%s); exiting", role.job.rank, exc)
        code = 1
    finally:
        if server.engine is not None:
            server.engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    distributed.release_job_stores()
    sys.exit(code)
