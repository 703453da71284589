"""Planning a step's micro-batches (one process): the balanced split, the budget, the
accumulation a plan sets and the errors of a plan not run as planned."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from lightrft.strategy import PlanError, get_fake_strategy
from lightrft.strategy.micro_batches import karmarkar_karp, split_step


def test_karmarkar_karp_balances_better_than_dealing_sorted() -> None:
    rng = random.Random(0)
    weights = [int(rng.lognormvariate(4, 1)) + 1 for _ in range(40)]
    parts = karmarkar_karp(weights, 4)
    assert sorted(i for part in parts for i in part) == list(range(40))
    sums = [sum(weights[i] for i in part) for part in parts]
    order = sorted(range(40), key=lambda i: -weights[i])
    dealt = [sum(weights[i] for i in order[k::4]) for k in range(4)]
    assert max(sums) - min(sums) <= max(dealt) - min(dealt)
    assert max(sums) - min(sums) <= max(weights) // 4 + 1
    assert karmarkar_karp([5, 3], 3)[2] == []  # more parts than items: empty parts


def test_a_skewed_step_gets_the_same_count_on_every_rank_under_the_budget() -> None:
    short, long = [10, 12, 9, 11, 8, 10], [60, 45, 70, 50, 55, 65]
    splits = split_step([short, long], budget=128, micro_batch_size=2)
    assert len(splits[0]) == len(splits[1]) == 3  # 345 tokens need 3 micro-batches
    for lengths, split in zip([short, long], splits, strict=True):
        assert sorted(i for part in split for i in part) == list(range(6))
        assert all(sum(lengths[i] for i in part) <= 128 for part in split)
    # the rank with short samples balances them over the same count
    sums = [sum(short[i] for i in part) for part in splits[0]]
    assert max(sums) - min(sums) <= 2


def test_a_sample_over_the_budget_runs_alone_with_a_warning() -> None:
    split = split_step([[300, 20, 30]], budget=64, micro_batch_size=1)[0]
    assert [0] in split and all(sum([300, 20, 30][i] for i in p) <= 64 for p in split if p != [0])


def test_fixed_micro_batches_and_empty_ones_for_a_rank_with_fewer_samples() -> None:
    splits = split_step([[5] * 5, [5] * 2], budget=None, micro_batch_size=2)
    assert splits[0] == [[0, 1], [2, 3], [4]]
    assert splits[1] == [[0, 1], [], []]


def test_a_plan_sets_the_step_accumulation_and_the_loss_scale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = get_fake_strategy(
        micro_train_batch_size=2, train_batch_size=2, packing_samples=True,
        max_tokens_per_gpu=16, max_norm=0.0,
    )  # fmt: skip
    model = nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        plan = strategy.plan_micro_batches([10, 6, 8, 20], loss_tokens=[4, 2, 3, 5])
    assert "1 sample(s) over max_tokens_per_gpu=16 (the longest, sample 3, has 20" in caplog.text
    assert plan.num_micro_batches == 3 and [3] in plan.micro_batches
    assert (plan.total_tokens, plan.total_samples, plan.ranks) == (14, 4, 1)
    stepped = []
    with plan:
        for _ in plan.micro_batches:
            strategy.backward(model(torch.ones(1, 2)).sum(), model, optim)
            stepped.append(strategy.optimizer_step(optim, model))
    assert stepped == [False, False, True]
    # after the plan, the config's fixed accumulation (1) again
    strategy.backward(model(torch.ones(1, 2)).sum(), model, optim)
    assert strategy.optimizer_step(optim, model)


def test_a_plan_left_with_micro_batches_unrun_is_an_error_naming_the_fix() -> None:
    strategy = get_fake_strategy(micro_train_batch_size=1, train_batch_size=1)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        strategy.plan_micro_batches([3, 0])
    with pytest.raises(ValueError, match="2 lengths but 1 loss_tokens"):
        strategy.plan_micro_batches([3, 3], [1])
    model = nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = strategy.plan_micro_batches([3, 3])
    strategy.backward(model(torch.ones(1, 2)).sum(), model, optim)
    strategy.optimizer_step(optim, model)
    with pytest.raises(PlanError, match="once for every micro-batch"):
        plan.finish()
    with pytest.raises(PlanError, match="1 micro-step"):  # the accumulation under way
        strategy.plan_micro_batches([3, 3])
