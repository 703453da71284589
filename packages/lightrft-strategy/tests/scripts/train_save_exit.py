"""A plain user script, run under torchrun: train, save a checkpoint, close, return.

torchrun --nproc-per-node 2 train_save_exit.py OUT_DIR [--backend fsdp2|zero3]
    [--engine none|fake] [--rebuilds N] [--no-close]

It ends the way a user's script ends (no ``os._exit``), so its exit status is what a
scheduler sees. ``--rebuilds N`` closes the strategy and builds a new one N times in
the same job, each training a step. ``--no-close`` leaves the strategy open at
interpreter exit. Rank 0 writes ``OUT_DIR/report.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import workers

from lightrft.engines import SamplingParams
from lightrft.strategy import get_strategy
from lightrft.testing import FakeEngine


def build(backend: str) -> object:
    changes = {"backend": "deepspeed", "zero_stage": 3} if backend == "zero3" else {}
    # one micro-batch per step per rank: every step ends in the optimizer's collectives
    return get_strategy(workers.config(train_batch_size=4, **changes))


def train_once(strategy, out: Path, engine: bool, save: bool) -> float:  # type: ignore[no-untyped-def]
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        workers.TinyRegressor(), None, None, None, None, 10
    )
    if engine:
        strategy.setup_inference_engine(FakeEngine(vocab_size=16), actor=actor)
        strategy.gather_and_generate([[1, 2]], SamplingParams(max_new_tokens=3))
    _, x, y = next(iter(strategy.setup_dataloader(workers.RegressionTask())))
    loss = nn.functional.mse_loss(actor(x), y)
    strategy.backward(loss, actor, optim)
    strategy.optimizer_step(optim, actor, sched)
    if save:
        strategy.save_ckpt(actor, out / "ckpt")
    return float(strategy.all_reduce(loss.detach()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", choices=["fsdp2", "zero3"], default="fsdp2")
    parser.add_argument("--engine", choices=["none", "fake"], default="none")
    parser.add_argument("--rebuilds", type=int, default=0)
    parser.add_argument("--no-close", action="store_true")
    args = parser.parse_args()
    losses = []
    for _ in range(args.rebuilds):
        strategy = build(args.backend)
        losses.append(train_once(strategy, args.out, args.engine == "fake", save=False))
        strategy.close()
    strategy = build(args.backend)
    losses.append(train_once(strategy, args.out, args.engine == "fake", save=True))
    if strategy.is_rank_0():
        report = {"world_size": strategy.world_size, "losses": losses, "builds": len(losses)}
        (args.out / "report.json").write_text(json.dumps(report))
    if not args.no_close:
        strategy.close()


if __name__ == "__main__":
    main()
