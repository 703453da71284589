"""lightrft.testing.harness: the README's example runs as written, and the harness
catches a strategy that trains differently from the plain-torch reference."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch

from lightrft.testing.harness import assert_states_close, reference, train, upstream_lr_factor
from lightrft.testing.models import RegressionTask, TinyRegressor

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_harness_example() -> str:
    section = README.read_text().split("## Tiny models and a training harness")[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's harness section lost its example"
    return match.group(1)


def test_the_readmes_harness_example_runs_on_two_fsdp2_ranks() -> None:
    scope: dict[str, object] = {}
    exec(_readme_harness_example(), scope)  # asserts parity itself
    ranks = scope["ranks"]
    assert isinstance(ranks, list) and len(ranks) == 2
    assert ranks[0]["stepped"] == [False, True] * 3  # 2 micro-batches a step
    assert ranks[1]["state"] is None  # the full state is rank 0's


def _fake(**changes: object) -> dict[str, object]:
    cfg: dict[str, object] = {
        "backend": "fake", "precision": "fp32", "seed": 3, "train_batch_size": 4,
        "micro_train_batch_size": 2, "max_norm": 0.5, "actor_learning_rate": 1e-2,
        "lr_scheduler": "cosine_with_min_lr", "lr_warmup_ratio": 0.5, "l2": 0.1,
    }  # fmt: skip
    cfg.update(changes)
    return cfg


def test_reference_equals_a_strategy_only_with_the_same_schedule_and_model() -> None:
    cfg = _fake()
    model = partial(TinyRegressor, dim=8, outputs=2, blocks=2)
    task = partial(RegressionTask, size=32, dim=8, outputs=2)
    run = train(cfg, 4, model=model, task=task, max_steps=4)
    schedule = partial(upstream_lr_factor, warmup=2, total=4)
    same = reference(cfg, 4, [run["used"]], model=model, task=task, lr_factor=schedule)
    torch.testing.assert_close(run["losses"], same["losses"], rtol=1e-5, atol=1e-6)
    assert_states_close(run["state"], same["state"], rtol=1e-5, atol=1e-6)
    constant = reference(cfg, 4, [run["used"]], model=model, task=task)  # no schedule
    with pytest.raises(AssertionError, match=r"^layers\.0\.|^head\."):
        assert_states_close(run["state"], constant["state"], rtol=1e-5, atol=1e-6)


def test_reference_starts_from_the_recorded_initial_weights() -> None:
    """record_initial/initial: a model whose random weights came from another generator
    (ZeRO-3's init on CUDA) is compared from where it really started."""
    cfg = _fake(lr_scheduler="constant_with_warmup", lr_warmup_ratio=0.0)

    def shifted() -> TinyRegressor:  # the same model, other initial weights
        torch.manual_seed(99)
        return TinyRegressor()

    run = train(cfg, 3, model=shifted, record_initial=True)
    assert_states_close(run["initial"], shifted().state_dict(), rtol=0, atol=0)
    seeded = reference(cfg, 3, [run["used"]])  # TinyRegressor() seeded by cfg["seed"]
    assert abs(seeded["losses"][0] - run["losses"][0]) > 1e-3
    same = reference(cfg, 3, [run["used"]], initial=run["initial"])
    torch.testing.assert_close(run["losses"], same["losses"], rtol=1e-5, atol=1e-6)
    assert_states_close(run["state"], same["state"], rtol=1e-5, atol=1e-6)


def test_assert_states_close_names_missing_entries() -> None:
    state = TinyRegressor().state_dict()
    fewer = {k: v for k, v in state.items() if k != "head.bias"}
    with pytest.raises(AssertionError, match=r"state keys differ: \['head.bias'\]"):
        assert_states_close(state, fewer)


def test_regression_task_rejects_more_outputs_than_inputs() -> None:
    with pytest.raises(ValueError, match="outputs=5 must be <= dim=4"):
        RegressionTask(dim=4, outputs=5)
