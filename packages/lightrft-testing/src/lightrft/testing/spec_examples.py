"""The three usage examples of the original specification (``使用模式``), kept word for
word, and rank functions that run them on a backend.

The examples are fragments: they use names they never define (``args``, ``actor``,
``dataloader``, ``compute_loss``...). Each runner binds those names first and then
executes the example's own text. One line is added to the first example, and it is
shown separately (:data:`EXAMPLE_1_UNPACK`): ``prepare_models_and_optimizers`` returns
``(model, optimizer, scheduler)`` triples (upstream's does too), while the example's
loop uses ``actor``, ``actor_optimizer`` and ``actor_scheduler`` as separate names.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.testing.models import TinyRegressor

#: Example 1 (基本用法), up to and including the preparation of the models.
EXAMPLE_1_PREPARE = """\
from lightrft.strategy import get_strategy

# 初始化策略
strategy = get_strategy(args)

# 准备模型和优化器
actor, critic, reward_models, initial_model = strategy.prepare_models_and_optimizers(
    actor, critic, reward_models, initial_model, args, max_steps
)
"""

#: The one line the runner adds between the two halves of example 1.
EXAMPLE_1_UNPACK = "actor, actor_optimizer, actor_scheduler = actor\n"

#: Example 1 (基本用法), the training loop.
EXAMPLE_1_LOOP = """\
# 训练循环
for batch in dataloader:
    loss = compute_loss(batch)
    strategy.backward(loss, actor, actor_optimizer)
    strategy.optimizer_step(actor_optimizer, actor, actor_scheduler)
"""

#: Example 2 (配置驱动用法); ``get_strategy`` comes from example 1's import.
EXAMPLE_2 = """\
from lightrft.strategy.config import StrategyConfig

# 创建配置
config = StrategyConfig(
    seed=42,
    max_norm=1.0,
    micro_train_batch_size=4,
    train_batch_size=32,
    bf16=True,
    zero_stage=2
)

# 使用配置创建策略
strategy = get_strategy(config)
"""

#: Example 3 (使用 FakeStrategy 进行测试).
EXAMPLE_3 = """\
from lightrft.strategy import get_fake_strategy

# 使用伪策略进行测试
strategy = get_fake_strategy()

# 所有操作无需分布式环境即可运行
strategy.setup_distributed()
strategy.backward(loss, model, optimizer)
strategy.save_ckpt(model, "checkpoints")
"""

DIM = 8


def _net() -> nn.Module:
    return TinyRegressor(dim=DIM, outputs=2, blocks=1)


def _batches(count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, DIM, generator=gen), torch.randn(size, 2, generator=gen))
            for _ in range(count)]  # fmt: skip


def run_example_1(args: dict[str, Any], micro_batches: int, close: bool = True) -> dict[str, Any]:
    """Example 1 with ``args`` (a namespace of these fields), a small model as
    ``actor`` and ``micro_batches`` micro-batches of this rank's data as
    ``dataloader``. Returns the optimizer steps taken, the accumulation, and whether
    the weights moved. ``close=False`` leaves the strategy's process group up."""
    import argparse

    torch.manual_seed(0)
    scope: dict[str, Any] = {
        "args": argparse.Namespace(**args),
        "actor": _net(),
        "critic": None,
        "reward_models": None,
        "initial_model": None,
        "max_steps": 10,
    }
    exec(EXAMPLE_1_PREPARE, scope)
    exec(EXAMPLE_1_UNPACK, scope)
    strategy, actor = scope["strategy"], scope["actor"]
    before = {k: v.clone() for k, v in strategy.full_state_dict(actor).items()}
    rank = strategy.get_rank()

    def compute_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(strategy.device) for t in batch)
        return nn.functional.mse_loss(actor(x), y)

    scope["compute_loss"] = compute_loss
    scope["dataloader"] = _batches(micro_batches, args["micro_train_batch_size"], seed=rank)
    exec(EXAMPLE_1_LOOP, scope)
    after = strategy.full_state_dict(actor)
    result = {
        "type": type(strategy).__name__,
        "world": strategy.world_size,
        "accumulated": strategy.accumulated_gradient,
        "steps": strategy.step_state(actor).global_steps,
        "moved": rank != 0 or any(not torch.equal(before[k], after[k]) for k in before),
    }
    if close:
        strategy.close()
    return result


def run_example_2(backend: dict[str, Any]) -> dict[str, Any]:
    """Example 2, with ``get_strategy`` bound to the backend under test (the example's
    config selects DeepSpeed by upstream's rule; ``backend`` fields win over it)."""
    from lightrft.strategy import get_strategy

    scope: dict[str, Any] = {"get_strategy": functools.partial(get_strategy, **backend)}
    exec(EXAMPLE_2, scope)
    strategy = scope["strategy"]
    result = {
        "type": type(strategy).__name__,
        "ready": strategy.is_ready,
        "world": strategy.world_size,
        "accumulated": strategy.accumulated_gradient,
        "seed": strategy.seed,
        "bf16": strategy.config.bf16,
    }
    strategy.close()
    return result


def run_example_3(workdir: str | Path) -> dict[str, Any]:
    """Example 3 in ``workdir`` (its checkpoint directory is relative), with a small
    ``model``, an AdamW ``optimizer`` and a ``loss`` computed by the model."""
    model = _net()
    x, y = _batches(1, 4, seed=0)[0]
    scope: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters()),
        "loss": nn.functional.mse_loss(model(x), y),
    }
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        exec(EXAMPLE_3, scope)
    finally:
        os.chdir(previous)
    strategy = scope["strategy"]
    return {
        "type": type(strategy).__name__,
        "accumulated": strategy.accumulated_gradient,
        "grads": all(p.grad is not None for p in model.parameters()),
        "latest": (Path(workdir) / "checkpoints" / "latest").read_text().strip(),
    }
