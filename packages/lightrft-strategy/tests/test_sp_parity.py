"""Ulysses sequence parallelism against the same global batch at ``sp_size = 1``, on
real gloo ranks: per-token log-probabilities, the loss, every gradient of the first
step and the parameters after three steps, for a tiny Qwen2 on a padded batch and on a
packed batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.testing.launcher import run_distributed

from .sp_workers import LENGTH, ROWS, checkpoint_case, parity_case

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

KINDS = ["padded", "packed"]


def _sizes(world: int, sp: int) -> dict[str, Any]:
    # one optimizer step per global batch; a sequence-parallel group is one replica
    replicas = world // sp
    return {"sp_size": sp, "micro_train_batch_size": ROWS // replicas, "train_batch_size": ROWS}


def assert_parity(reference: dict[str, Any], ranks: list[dict[str, Any]], kind: str) -> None:
    ref = reference[kind]
    assert ref["layer_tokens"][0] == [ROWS, LENGTH]  # one rank: every row, every token
    replica_rows = 2 * ROWS // len(ranks)  # sp_size 2: one replica per 2 ranks
    for rank in ranks:  # the replica's rows once, half of the (padded) sequence each
        assert rank[kind]["layer_tokens"][0] == [replica_rows, (LENGTH + 1) // 2]
        got = rank[kind]
        rows = slice(*got["rows"])
        keep = got["scored"]
        torch.testing.assert_close(got["scored"], ref["scored"][rows])
        # per-token log-probabilities of the real predictions, within fp32 tolerance
        torch.testing.assert_close(
            got["log_probs"][keep], ref["log_probs"][rows][keep], atol=2e-5, rtol=1e-5
        )
    # each rank's loss is the mean over its replica's rows: their mean is the batch's
    losses = [rank[kind]["loss"] for rank in ranks]
    assert sum(losses) / len(losses) == pytest.approx(ref["loss"], abs=1e-5)
    for name, grad in ref["grads"].items():  # every gradient, as the optimizer saw it
        got = ranks[0][kind]["grads"][name]
        assert torch.allclose(got, grad, atol=1e-6, rtol=1e-4), (
            f"{kind}: gradient of {name} differs by {(got - grad).abs().max():.3g}"
        )
    # three Adam steps later: Adam divides by sqrt(v), so a parameter whose gradient is
    # near zero turns fp32 rounding into up to ~1% of one step (lr 5e-3)
    for name, value in ref["params"].items():
        got = ranks[0][kind]["params"][name]
        assert torch.allclose(got, value, atol=1e-4, rtol=1e-4), (
            f"{kind}: parameter {name} differs by {(got - value).abs().max():.3g}"
        )


@pytest.fixture(scope="module")
def fsdp2_reference() -> dict[str, Any]:
    (ref,) = run_distributed(parity_case, 1, {"backend": "fsdp2", **_sizes(1, 1)}, KINDS,
                             timeout=300)  # fmt: skip
    return ref


def test_fsdp2_sp2_on_two_ranks_equals_one_rank(fsdp2_reference: dict[str, Any]) -> None:
    ranks = run_distributed(parity_case, 2, {"backend": "fsdp2", **_sizes(2, 2)}, KINDS,
                            timeout=300)  # fmt: skip
    for kind in KINDS:
        assert_parity(fsdp2_reference, ranks, kind)


def test_fsdp2_sp2_by_dp2_on_four_ranks_equals_one_rank(fsdp2_reference: dict[str, Any]) -> None:
    ranks = run_distributed(parity_case, 4, {"backend": "fsdp2", **_sizes(4, 2)}, ["padded"],
                            timeout=300)  # fmt: skip
    assert [r["padded"]["rows"] for r in ranks] == [[0, 2], [0, 2], [2, 4], [2, 4]]
    assert_parity(fsdp2_reference, ranks, "padded")


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_sp2_on_two_ranks_equals_one_rank(stage: int) -> None:
    cfg = {"backend": "deepspeed", "zero_stage": stage}
    (reference,) = run_distributed(parity_case, 1, {**cfg, **_sizes(1, 1)}, KINDS, timeout=400)
    ranks = run_distributed(parity_case, 2, {**cfg, **_sizes(2, 2)}, KINDS, timeout=400)
    for kind in KINDS:
        assert_parity(reference, ranks, kind)


def test_checkpoints_move_between_sp_size_2_and_1(tmp_path: Path) -> None:
    """sp_size changes no parameter layout: a checkpoint saved at sp_size=2 loads at
    sp_size=1 and back, and a run continued across the change ends where an
    uninterrupted sp_size=2 run does."""
    sp2, sp1 = {"backend": "fsdp2", **_sizes(2, 2)}, {"backend": "fsdp2", **_sizes(2, 1)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = run_distributed(checkpoint_case, 2, sp2, 1, None, a, timeout=300)[0]
    moved = run_distributed(checkpoint_case, 2, sp1, 1, a, b, timeout=300)[0]
    back = run_distributed(checkpoint_case, 2, sp2, 0, b, None, timeout=300)[0]
    straight = run_distributed(checkpoint_case, 2, sp2, 2, None, None, timeout=300)[0]
    for name, value in first["final"].items():
        assert torch.equal(moved["loaded"][name], value), name  # sp_size 2 -> 1: exact
        assert torch.equal(back["loaded"][name], moved["final"][name]), name  # 1 -> 2
        assert torch.allclose(moved["final"][name], straight["final"][name], atol=1e-4), name
