"""Run under torchrun: train a few steps, checkpoint, reload; rank 0 writes a report.

torchrun --nnodes 2 --nproc-per-node 1 ... two_node_train.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import workers

from lightrft.strategy import get_strategy


def main(out: Path) -> None:
    strategy = get_strategy(workers.config())
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        workers.TinyRegressor(), None, None, None, None, 10
    )
    batches = iter(strategy.setup_dataloader(workers.RegressionTask()))
    losses = []
    for _ in range(2 * strategy.accumulated_gradient):
        _, x, y = next(batches)
        loss = nn.functional.mse_loss(actor(x), y)
        strategy.backward(loss, actor, optim)
        if strategy.optimizer_step(optim, actor, sched):
            losses.append(float(strategy.all_reduce(loss.detach())))
    path = strategy.save_ckpt(actor, out / "ckpt")
    before = strategy.full_state_dict(actor)
    strategy.load_ckpt(actor, out / "ckpt")
    after = strategy.full_state_dict(actor)
    ranks = strategy.all_gather(strategy.get_rank())
    if strategy.is_rank_0():
        same = all(torch.equal(before[k], after[k]) for k in before)
        report = {
            "world_size": strategy.world_size,
            "launcher": strategy.launch.launcher,
            "ranks": ranks,
            "losses": losses,
            "checkpoint": path.name,
            "reload_identical": same,
            "node_rank_env": os.environ.get("GROUP_RANK"),
        }
        (out / "report.json").write_text(json.dumps(report))
    strategy.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
