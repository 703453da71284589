"""Upstream's sequence-parallel names (``lightrft.strategy.utils.parallel_utils``) on 2
real gloo ranks: the groups the strategy builds, ``sp_data_processor`` in upstream's
call shapes, input slicing and padding, and the autograd exchanges checked against the
same computation done whole on one rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing.launcher import run_distributed

from .sp_workers import rollouts_case

pytestmark = [pytest.mark.timeout(300)]


def _sp_case(sp_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightrft.strategy.utils import parallel_utils as pu  # upstream's import path

    strategy = FSDP2Strategy(device="cpu", sp_size=sp_size, train_batch_size=4,
                             micro_train_batch_size=2)  # fmt: skip
    rank = strategy.get_rank()
    out: dict[str, Any] = {
        "size": pu.get_sequence_parallel_world_size(),
        "rank": pu.get_sequence_parallel_rank(),
        "processor_is_upstreams": isinstance(strategy.sp_data_processor, pu.SPDataProcessor),
    }
    # upstream's experience maker: preprocess a rank's samples, postprocess the results;
    # the strategy's processor leaves them (its loader gives a group the same items)
    mine = [f"r{rank}a", f"r{rank}b"]
    out["strategy_keeps"] = (
        strategy.sp_data_processor.preprocess(mine)
        == mine
        == (strategy.sp_data_processor.postprocess(mine))
    )
    processor = pu.SPDataProcessor()  # upstream's own meaning: gather, then share
    gathered = processor.preprocess(mine)
    out["gathered"] = gathered
    out["back"] = processor.postprocess(gathered)
    # a packed row of 5 tokens, padded to a multiple of the group and sliced
    ids = torch.arange(10, 15).unsqueeze(0)
    pos = torch.tensor([[0, 1, 2, 0, 1]])  # two packed samples
    sliced, padded_pos, pad = pu.sp_slice_and_pad_input(ids, pos)
    out["slice"], out["pos"], out["pad"] = sliced.tolist(), padded_pos.tolist(), pad
    group = pu.get_sequence_parallel_group()
    # gather forward / split backward: the gradient of the whole reaches each slice
    torch.manual_seed(0)
    whole = torch.randn(1, 6, 4, requires_grad=True)
    part = whole.detach()[:, 3 * out["rank"] : 3 * (out["rank"] + 1)].clone().requires_grad_()
    if out["size"] == 1:
        part = whole.detach().clone().requires_grad_()
    full = pu.gather_forward_split_backward_and_unpad(part, group, 1, padding_size=1, unpad_dim=1)
    weight = torch.arange(20.0).reshape(1, 5, 4)
    (full * weight).sum().backward()
    (whole[:, :5] * weight).sum().backward()
    local = slice(3 * out["rank"], 3 * (out["rank"] + 1)) if out["size"] > 1 else slice(None)
    out["gathered_ok"] = torch.equal(full.detach(), whole.detach()[:, :5])
    out["split_grad_ok"] = torch.equal(part.grad, whole.grad[:, local])
    # Ulysses all-to-all: [batch, seq/k, heads, dim] <-> [batch, seq, heads/k, dim]
    torch.manual_seed(1)
    qkv = torch.randn(1, 4, 2, 3, requires_grad=True)  # the whole sequence, 2 heads
    local_seq = slice(2 * out["rank"], 2 * (out["rank"] + 1)) if out["size"] > 1 else slice(None)
    mine = qkv.detach()[:, local_seq].clone().requires_grad_()
    heads = pu._SeqAllToAll.apply(group, 2, 1, mine)  # scatter heads, gather sequence
    local_heads = slice(out["rank"], out["rank"] + 1) if out["size"] > 1 else slice(None)
    out["a2a_ok"] = torch.equal(heads.detach(), qkv.detach()[:, :, local_heads])
    (heads * 2).sum().backward()
    out["a2a_grad_ok"] = torch.equal(mine.grad, torch.full_like(mine, 2.0))
    a, b = pu._SeqAllToAll.apply(group, [2, 2], [1, 1], mine.detach(), mine.detach() * 3)
    out["a2a_pair_ok"] = torch.equal(b, a * 3)
    dist.barrier()
    strategy.close()
    out["size_after_close"] = pu.get_sequence_parallel_world_size()
    return out


@pytest.mark.distributed
def test_sp_size_2_groups_processor_slices_and_exchanges() -> None:
    r0, r1 = run_distributed(_sp_case, 2, 2, init_process_group=False)
    for r, rank in ((r0, 0), (r1, 1)):
        assert (r["size"], r["rank"], r["processor_is_upstreams"]) == (2, rank, True)
        assert r["strategy_keeps"]
        assert r["gathered"] == ["r0a", "r0b", "r1a", "r1b"]  # the group's items, rank order
        assert r["back"] == ["r0a", "r0b", "r1a", "r1b"][2 * rank : 2 * rank + 2]
        assert r["pad"] == 1 and r["pos"] == [[0, 1, 2, 0, 1, 0]]  # positions: not sliced
        assert r["gathered_ok"] and r["split_grad_ok"]
        assert r["a2a_ok"] and r["a2a_grad_ok"] and r["a2a_pair_ok"]
        assert r["size_after_close"] == 1
    assert r0["slice"] == [[10, 11, 12]] and r1["slice"] == [[13, 14, 0]]


@pytest.mark.distributed
def test_sp_size_1_is_the_identity_with_upstreams_group_of_one() -> None:
    r0, r1 = run_distributed(_sp_case, 2, 1, init_process_group=False)
    for r in (r0, r1):
        assert (r["size"], r["rank"]) == (1, 0)
        assert r["back"] == r["gathered"] and len(r["gathered"]) == 2  # own items only
        assert r["slice"] == [[10, 11, 12, 13, 14]] and r["pad"] == 0
        assert r["gathered_ok"] and r["split_grad_ok"] and r["a2a_ok"] and r["a2a_grad_ok"]


def test_a_group_of_a_destroyed_world_is_forgotten() -> None:
    """A strategy dropped without close() and its process group torn down (as a
    leak-cleaning fixture does) must not leave the next strategy a dead group."""
    import torch.distributed as dist

    from lightrft.strategy import sequence_parallel as sp

    FSDP2Strategy(device="cpu")
    assert sp.get_sequence_parallel_group() is not None  # upstream's group of one
    dist.destroy_process_group()
    assert sp.get_sequence_parallel_group() is None
    assert (sp.get_sequence_parallel_world_size(), sp.get_sequence_parallel_rank()) == (1, 0)
    strategy = FSDP2Strategy(device="cpu")
    assert strategy.sp_data_processor.sp_size == 1
    strategy.close()


@pytest.mark.distributed
def test_a_sequence_parallel_group_generates_its_rollouts_once() -> None:
    """The ranks of a group hold the same prompts: the first generates, the other gets
    the same outputs without calling its engine. Different prompts: each its own."""
    ranks = run_distributed(rollouts_case, 2, {"sp_size": 2, "train_batch_size": 4},
                            timeout=200)  # fmt: skip
    assert [r["same_calls"] for r in ranks] == [1, 0]
    assert ranks[0]["same_prompts"] == [[1, 2], [3]]
    assert ranks[0]["same"] == ranks[1]["same"] and len(ranks[0]["same"]) == 4
    assert [r["own_calls"] for r in ranks] == [1, 1]
    assert ranks[0]["own"] != ranks[1]["own"]
