"""The learning-rate schedules equal transformers' get_scheduler of the same name, the
function upstream LightRFT builds its schedules with (an independent reference)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightrft.config import StrategyConfig
from lightrft.strategy.optim import build_scheduler


def _lrs(scheduler: object, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
    return lrs


@pytest.mark.parametrize("kind", ["cosine_with_min_lr", "cosine", "linear", "constant_with_warmup"])
@pytest.mark.parametrize(("max_steps", "warmup_ratio"), [(8, 0.5), (100, 0.03), (10, 0.0)])
def test_schedule_equals_transformers_get_scheduler(
    kind: str, max_steps: int, warmup_ratio: float
) -> None:
    from transformers import get_scheduler

    config = StrategyConfig(lr_scheduler=kind, lr_warmup_ratio=warmup_ratio, min_lr_ratio=0.1)
    ours = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    theirs = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    warmup = -(-max_steps * warmup_ratio // 1)  # ceil, as upstream computes it
    extra = {"scheduler_specific_kwargs": {"min_lr": 0.2}} if kind == "cosine_with_min_lr" else {}
    reference = get_scheduler(kind, theirs, num_warmup_steps=int(warmup),
                              num_training_steps=max_steps, **extra)  # fmt: skip
    expected = _lrs(reference, theirs, max_steps)
    got = _lrs(build_scheduler(ours, config, max_steps), ours, max_steps)
    assert got == pytest.approx(expected, abs=1e-12)
