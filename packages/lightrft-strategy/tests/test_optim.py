"""Optimizer groups (no weight decay on biases and norms) and learning-rate schedules.

The learning-rate schedules equal transformers' get_scheduler of the same name, the
function upstream LightRFT builds its schedules with (an independent reference)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightrft.config import StrategyConfig
from lightrft.strategy.optim import build_scheduler, parameter_groups

from . import workers


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


def test_weight_decay_excludes_biases_and_norms() -> None:
    model = workers.TinyRegressor()
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(n.endswith(".weight") and ".norm." not in n for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} >= {"layers.0.norm.weight", "head.bias"}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


@pytest.mark.parametrize(
    ("kind", "at_end"),
    [("cosine_with_min_lr", 0.1), ("cosine", 0.0), ("linear", 0.0), ("constant_with_warmup", 1.0)],
)
def test_schedules_warm_up_then_follow_their_shape(kind: str, at_end: float) -> None:
    optim = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(optim, StrategyConfig(lr_warmup_ratio=0.1, lr_scheduler=kind), 100)
    lrs = []
    for _ in range(100):
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.1)  # warmup from 0: 10 steps
    assert lrs[10] == pytest.approx(1.0)
    assert optim.param_groups[0]["lr"] == pytest.approx(at_end, abs=1e-9)
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(lrs[10:]))
