"""Rank functions and reference computations for the distributed tests.

They live in an importable module so the launcher's spawned processes can find them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lightrft.strategy import get_strategy

DIM = 16


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class TinyNet(nn.Module):
    """Residual MLP blocks in an nn.ModuleList, so FSDP2 shards block by block."""

    def __init__(self, dropout: float = 0.0, blocks: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(dropout) for _ in range(blocks)])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class IndexedRegression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int = 128) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, DIM, generator=gen)
        self.y = self.x[:, :4] * 3.0 + 0.1 * torch.randn(size, 4, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def config(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "backend": "fsdp2",
        "device": "cpu",
        "bf16": False,
        "seed": 0,
        "train_batch_size": 8,
        "micro_train_batch_size": 2,
        "max_norm": 0.3,
        "actor_learning_rate": 5e-3,
        "lr_warmup_ratio": 0.0,
        "lr_scheduler": "constant_with_warmup",
        "l2": 0.01,
    }
    base.update(changes)
    return base


def train(
    cfg: dict[str, Any],
    steps: int,
    *,
    dropout: float = 0.0,
    save_dir: str | None = None,
    load_dir: str | None = None,
    total_steps: int = 100,
    meta_init: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; optionally resume from ``load_dir`` first and
    save to ``save_dir`` after. Returns losses, sample indices used, grad norms, and
    (rank 0) the full final state dict."""
    strategy = get_strategy(cfg)
    strategy.setup_distributed()
    with strategy.init_model_context(meta_init=meta_init):
        model = TinyNet(dropout)
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=total_steps
    )
    loader = strategy.setup_dataloader(IndexedRegression())
    if load_dir is not None:
        strategy.load_ckpt(actor, load_dir)
    batches = iter(loader)
    losses, used, norms = [], [], []
    for _ in range(steps):
        micro_losses = []
        for _ in range(strategy.accumulated_gradient):
            index, x, y = next(batches)
            loss = nn.functional.mse_loss(actor(x), y)
            strategy.backward(loss, actor, optim)
            strategy.optimizer_step(optim, actor, sched)
            micro_losses.append(loss.detach())
            used.append(index.tolist())
        losses.append(float(strategy.all_reduce(torch.stack(micro_losses).mean())))
        norms.append(strategy.step_state(actor).last_grad_norm)
    if save_dir is not None:
        strategy.save_ckpt(actor, save_dir)
    state = strategy.full_state_dict(actor)
    rank = strategy.get_rank()
    strategy.close()
    return {
        "losses": losses,
        "used": used,
        "norms": norms,
        "state": state if rank == 0 else None,
    }


def reference(cfg: dict[str, Any], steps: int, used_by_rank: list[list[list[int]]]) -> dict[str, Any]:
    """The same training in one process with plain torch: every rank's micro-batches,
    summed with weight 1 / (micro-batches x ranks), clipped, stepped."""
    torch.manual_seed(cfg["seed"])
    model = TinyNet()
    data = IndexedRegression()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg["l2"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg["actor_learning_rate"],
        betas=(0.9, 0.95),
    )
    world = len(used_by_rank)
    accum = len(used_by_rank[0]) // steps
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(accum):
            for rank in range(world):
                index = used_by_rank[rank][step * accum + k]
                loss = nn.functional.mse_loss(model(data.x[index]), data.y[index])
                (loss / (accum * world)).backward()
                total += loss.item() / (accum * world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_norm"])
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


def load_full_checkpoint(cfg: dict[str, Any], load_dir: str) -> dict[str, Any]:
    """Load ``load_dir`` at this run's world size; return rank 0's full model state."""
    strategy = get_strategy(cfg)
    strategy.setup_distributed()
    model = TinyNet()
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=100
    )
    path, client = strategy.load_ckpt(actor, Path(load_dir))
    state = strategy.full_state_dict(actor)
    rank, world = strategy.get_rank(), strategy.world_size
    strategy.close()
    return {"state": state if rank == 0 else None, "world": world, "path": path}
