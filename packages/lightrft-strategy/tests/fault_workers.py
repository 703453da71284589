"""Rank functions of the fault tests: a rank that stalls, a rank killed mid-phase.

Each job trains a TinyRegressor one micro-batch per step (so every step ends in the
optimizer's collectives), with the fake engine at tensor-parallel size 2 (generation
and weight sync involve both ranks). Rank 1 is the victim; rank 0 records what it saw.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.engines import SamplingParams
from lightrft.strategy import get_strategy
from lightrft.strategy.roll_call import CollectiveError
from lightrft.testing import FakeEngine
from lightrft.testing.models import RegressionTask, TinyRegressor
from tests import workers

PHASES = ("step", "save", "sync", "generate")


def fault_config(timeout_s: float, **changes: Any) -> dict[str, Any]:
    return workers.config(train_batch_size=4, engine_tp_size=2, dist_timeout_s=timeout_s, **changes)


def _die(out: Path, where: str) -> None:
    """SIGKILL this process, after writing when and where (for the survivor's bound)."""
    (out / "killed.json").write_text(json.dumps({"at": time.time(), "where": where}))
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingEngine(FakeEngine):
    """A fake engine that SIGKILLs its process at its ``kill_at``-th call of ``method``."""

    def __init__(self, out: Path, method: str | None, kill_at: int) -> None:
        super().__init__(vocab_size=16)
        self._out, self._method, self._left = out, method, kill_at

    def _count(self, method: str) -> None:
        if method == self._method:
            self._left -= 1
            if self._left == 0:
                _die(self._out, f"engine.{method}")

    def update_weights(self, named_tensors: Any) -> None:
        self._count("update_weights")
        super().update_weights(named_tensors)

    def generate(self, prompts: Any, sampling: Any = None) -> Any:
        self._count("generate")
        return super().generate(prompts, sampling)


def _dying_save(out: Path, kill_at: int) -> Callable[..., Any]:
    """``torch.save`` that kills the process at its ``kill_at``-th call."""
    real = torch.save
    calls = [0]

    def save(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == kill_at:
            _die(out, f"torch.save call {kill_at} of a checkpoint save")
        return real(*args, **kwargs)

    return save


def killed_rank_case(cfg: dict[str, Any], out_dir: str, phase: str, seed: int) -> dict[str, Any]:
    """Train a step, save a complete checkpoint (rank 0 keeps its full weights), then run
    a second step in which rank 1 dies in ``phase`` at a point drawn from ``seed``."""
    out = Path(out_dir)
    strategy = get_strategy(cfg)
    rank = strategy.get_rank()
    victim = rank == 1
    draw = random.Random(seed)
    # rank 1 calls torch.save 21 times in an FSDP2 checkpoint save, 3 times at ZeRO-3;
    # it sends 4 weight buckets and generates once a step
    saves = 3 if cfg.get("backend") == "deepspeed" else 21
    kill_at = {"save": draw.randint(1, saves), "sync": draw.randint(1, 4)}.get(phase, 1)
    method = {"sync": "update_weights", "generate": "generate"}.get(phase)
    engine = _DyingEngine(out, None, kill_at)  # armed for the faulty step only
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    strategy.setup_inference_engine(engine)
    batches = iter(strategy.setup_dataloader(RegressionTask()))

    def step(dying: bool) -> None:
        strategy.update_engine_weights(actor, bucket_bytes=64)  # several buckets
        strategy.gather_and_generate([[1, 2], [3]], SamplingParams(max_new_tokens=3))
        _, x, y = next(batches)
        loss = nn.functional.mse_loss(actor(x), y)
        if dying and draw.random() < 0.5:
            _die(out, "before backward")
        strategy.backward(loss, actor, optim)
        if dying:
            _die(out, "between backward and optimizer_step")
        strategy.optimizer_step(optim, actor, sched)
        strategy.all_reduce(loss.detach())

    step(dying=False)
    strategy.save_ckpt(actor, out / "ckpt")
    full = strategy.full_state_dict(actor)
    if rank == 0:
        torch.save(full, out / "complete_weights.pt")
    engine._method = method if victim else None
    try:
        step(dying=victim and phase == "step")
        if victim and phase == "save":
            torch.save = _dying_save(out, kill_at)  # type: ignore[assignment]
        strategy.save_ckpt(actor, out / "ckpt")
        strategy.all_reduce(1.0)
    except CollectiveError as error:
        report = {
            "detected_at": time.time(),
            "operation": error.operation,
            "rank": error.rank,
            "missing": {str(k): v for k, v in error.missing.items()},
            "message": str(error),
        }
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        raise
    return {"rank": rank, "finished": True}


def stuck_rank_case(cfg: dict[str, Any], stall_s: float) -> dict[str, Any]:
    """Rank 1 stalls between backward and optimizer_step (a slow step); rank 0 reaches
    the optimizer's gradient-norm reduction and waits there."""
    strategy = get_strategy(cfg)
    rank = strategy.get_rank()
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    _, x, y = next(iter(strategy.setup_dataloader(RegressionTask())))
    loss = nn.functional.mse_loss(actor(x), y)
    strategy.backward(loss, actor, optim)
    if rank == 1:
        time.sleep(stall_s)
    start = time.monotonic()
    try:
        strategy.optimizer_step(optim, actor, sched)
        strategy.all_reduce(loss.detach())
    except CollectiveError as error:
        return {
            "rank": rank,
            "waited_s": time.monotonic() - start,
            "operation": error.operation,
            "missing": error.missing,
            "message": str(error),
        }
    return {"rank": rank, "waited_s": time.monotonic() - start, "operation": None}


def _timeout_s(group: Any) -> float:
    return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def group_timeouts_case(cfg: dict[str, Any], setup_timeout_s: float | None) -> dict[str, float]:
    """The timeouts of the groups a strategy makes: the process group, the
    sequence-parallel group, the engine's tensor-parallel group."""
    import datetime

    import torch.distributed as dist

    from lightrft.strategy import sequence_parallel

    strategy = get_strategy(cfg, defer_setup=True)
    timeout = None if setup_timeout_s is None else datetime.timedelta(seconds=setup_timeout_s)
    strategy.setup_distributed(timeout=timeout)
    strategy.setup_inference_engine(FakeEngine(vocab_size=16))
    found = {
        "world": _timeout_s(dist.group.WORLD),
        "sequence_parallel": _timeout_s(sequence_parallel.get_sequence_parallel_group()),
        "engine_tp": _timeout_s(strategy.engine_link.engine_group),
    }
    strategy.close()
    return found
