"""Which ranks reached which collective: a roll call kept in the job's rendezvous store.

Every strategy operation that talks to the other ranks (a training step, a reduction,
a checkpoint save, a weight sync, a generation) first records, in the store, that this
rank arrived at it: one small ``set`` per operation. When the operation then fails
with a timeout or a lost connection, the roll call reads every rank's last arrival and
says which ranks never reached this operation, what they did last, and whether their
process is gone (checked for ranks on this host), instead of gloo's bare
"Timed out waiting 1800000ms" or "Connection closed by peer".
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

# Words of the errors a collective raises when a peer is slow or gone (gloo, NCCL, the
# store); an error without any of them is the operation's own and passes unchanged.
_PEER_FAILURE_WORDS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "socket closed",
    "connection refused",
    "ncclremoteerror",
    "ncclsystemerror",
)


# Those of a peer gone, not merely slow.
_LOST_CONNECTION_WORDS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "socket closed",
    "connection refused",
)


class CollectiveError(RuntimeError):
    """A collective did not complete: a rank was too slow (the timeout fired) or is gone.

    Attributes:
        operation: the strategy operation (``"all_reduce"``, ``"backward"``...).
        rank: this rank.
        missing: the ranks that did not reach the operation, with what they did last.
    """

    def __init__(self, message: str, operation: str, rank: int, missing: dict[int, str]) -> None:
        super().__init__(message)
        self.operation = operation
        self.rank = rank
        self.missing = missing


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's timeout or lost connection (not a bug of the
    operation itself, such as a shape mismatch)."""
    if isinstance(error, CollectiveError) or not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return any(word in text for word in _PEER_FAILURE_WORDS)


@dataclass
class _Arrival:
    seq: int
    operation: str


class RollCall:
    """This rank's side of the roll call over ``store`` (one per process group).

    Args:
        store: a store every rank of the group reaches (the group's own, prefixed).
        rank: this rank in the group.
        world_size: ranks in the group.
        timeout: the group's collective timeout, quoted in the errors.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._seq = 0
        self._depth = 0
        store.set(f"host/{rank}", f"{socket.gethostname()} {os.getpid()}")

    def arrive(self, operation: str) -> int:
        """Record that this rank reached ``operation``; returns its sequence number."""
        self._seq += 1
        self.store.set(f"at/{self.rank}", f"{self._seq} {operation}")
        return self._seq

    @contextlib.contextmanager
    def guard(self, operation: str, arrive: bool = True) -> Iterator[None]:
        """Run a collective operation: arrive, then turn a timeout or lost peer into a
        :class:`CollectiveError` naming the ranks that did not arrive. Nested guards
        (an operation made of others) count once, under the outermost name.
        ``arrive=False``: part of the operation last arrived at (no store write)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        seq = self.arrive(operation) if arrive else self._seq
        self._depth = 1
        try:
            yield
        except BaseException as error:
            if not is_peer_failure(error):
                raise
            raise self.error(operation, seq, error) from error
        finally:
            self._depth = 0

    def absent(self, seq: int) -> dict[int, str]:
        """The ranks whose last arrival is before ``seq``, with where they last were;
        a rank whose process has exited (checked on this host) says so."""
        missing: dict[int, str] = {}
        here = socket.gethostname()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            arrival = self._arrival(rank)
            gone = self._process_gone(rank, here)
            if arrival is not None and arrival.seq >= seq and not gone:
                continue
            where = (
                "never reached a strategy operation"
                if arrival is None
                else f"last reached {arrival.operation} #{arrival.seq}"
            )
            missing[rank] = f"{where}{gone}"
        return missing

    def error(self, operation: str, seq: int, cause: BaseException) -> CollectiveError:
        """The :class:`CollectiveError` for ``operation`` (#``seq``) failing with ``cause``."""
        try:
            missing = self._absent_settled(seq, cause)
        except Exception as store_error:  # the store's host may be the rank that is gone
            roll = (
                f"the roll call could not read the rendezvous store ({store_error}); the "
                "rank hosting it (rank 0, or node 0's launcher) is probably the one lost"
            )
            missing = {}
        else:
            roll = (
                "; ".join(f"rank {r} {where}" for r, where in sorted(missing.items()))
                if missing
                else "every rank reached it, so one failed inside it"
            )
        seconds = self.timeout.total_seconds()
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        message = (
            f"{operation} #{seq} failed on rank {self.rank} of {self.world_size}: {roll}. "
            f"The collective timeout is {seconds:g} s (StrategyConfig.dist_timeout_s, or "
            f"setup_distributed(timeout=...)). Cause: {first_line}"
        )
        return CollectiveError(message, operation, self.rank, missing)

    def _absent_settled(
        self, seq: int, cause: BaseException, wait_s: float = 5.0
    ) -> dict[int, str]:
        """:meth:`absent`; when the connection to a rank was lost, that rank was killed
        and its process may still be ending (a killed process closes its sockets before
        /proc shows it exited, later still on a loaded machine), so until one shows as
        exited look again for up to ``wait_s`` seconds (a rank on another host never
        shows: then the full wait)."""
        missing = self.absent(seq)
        lost = any(w in str(cause).lower() for w in _LOST_CONNECTION_WORDS)
        deadline = time.monotonic() + wait_s

        def settled() -> bool:  # a lost connection: some rank's process has exited
            return any("has exited" in where for where in missing.values())

        while lost and not settled() and time.monotonic() < deadline:
            time.sleep(0.1)
            missing = self.absent(seq)
        return missing

    def _arrival(self, rank: int) -> _Arrival | None:
        key = f"at/{rank}"
        if not self.store.check([key]):
            return None
        seq, _, operation = self.store.get(key).decode().partition(" ")
        return _Arrival(int(seq), operation)

    def _process_gone(self, rank: int, here: str) -> str:
        key = f"host/{rank}"
        if not self.store.check([key]):
            return ""
        host, _, pid = self.store.get(key).decode().partition(" ")
        if host != here:
            return ""
        if _exited(int(pid)):
            return f" (its process {pid} on this host has exited)"
        return ""


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has not reaped
    yet (Linux's ``/proc``; elsewhere only a reaped process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


_current: RollCall | None = None


def set_roll_call(roll_call: RollCall | None) -> None:
    """Make ``roll_call`` the one :func:`guard` uses (None: guards only pass through)."""
    global _current
    _current = roll_call


def current() -> RollCall | None:
    """The roll call of the strategy that owns the process group, if any."""
    return _current


@contextlib.contextmanager
def guard(operation: str, arrive: bool = True) -> Iterator[None]:
    """:meth:`RollCall.guard` of the current roll call; without one (no process group,
    or a world of one), just run."""
    roll_call = _current
    if roll_call is None or not dist.is_initialized():
        yield
        return
    with roll_call.guard(operation, arrive):
        yield


def guard_fsdp_forward(module: nn.Module, root: bool) -> None:
    """Gather an FSDP2 unit's parameters for forward under the guard ("forward"), so a
    rank missing from that all-gather is named too: FSDP2 gathers in a pre-forward hook,
    outside any strategy call. The root arrives; the blocks inside its forward do not
    (one store write per forward). The root's first forward, before FSDP2 has set the
    root up, gathers unguarded."""

    def gather(unit: Any, args: Any) -> None:
        del args
        if root and getattr(unit._get_fsdp_state(), "_is_root", None) is None:
            return  # FSDP2's lazy root setup first (in its own pre-forward hook)
        with guard("forward", arrive=root):
            unit.unshard()

    module.register_forward_pre_hook(gather, prepend=True)


def guard_forward(module: nn.Module) -> None:
    """Run ``module``'s forward under the guard ("forward"): for a DeepSpeed ZeRO-3
    engine, whose parameters are gathered by hooks inside its forward."""
    forward = module.forward

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with guard("forward"):
            return forward(*args, **kwargs)

    module.forward = guarded
