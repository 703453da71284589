"""Tests for lightrft.strategy.data: sharding, determinism and exact mid-epoch resume.

Ranks are simulated in one process by building one sampler or loader per rank.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from lightrft.strategy.data import (
    ResumableDataLoader,
    ResumableDistributedSampler,
    build_dataloader,
)


class _Range(Dataset[int]):
    """Sample i is the int i (module level so worker processes can pickle it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(4))


def _as_list(batch: Any) -> list[int]:
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


def _batches(loader: ResumableDataLoader, k: int | None = None) -> list[list[int]]:
    return [_as_list(b) for b in itertools.islice(loader, k)]


def _sampler(n: int, r: int, world: int, **kw: Any) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(n, num_replicas=world, rank=r, **kw)


def _loader(n: int, r: int, world: int, bs: int = 2, **kw: Any) -> ResumableDataLoader:
    return build_dataloader(_Range(n), bs, num_replicas=world, rank=r, seed=7, **kw)


# --- sampler: determinism and sharding ---------------------------------------------------


def test_same_seed_same_order() -> None:
    assert list(_sampler(50, 1, 2, seed=3)) == list(_sampler(50, 1, 2, seed=3))


def test_different_seed_or_epoch_changes_order() -> None:
    base = list(_sampler(50, 0, 2, seed=3))
    assert list(_sampler(50, 0, 2, seed=4)) != base
    other_epoch = _sampler(50, 0, 2, seed=3)
    other_epoch.set_epoch(1)
    assert list(other_epoch) != base
    other_epoch.set_epoch(0)
    assert list(other_epoch) == base


def test_no_shuffle_is_strided_identity() -> None:
    assert list(_sampler(10, 1, 3, shuffle=False)) == [1, 4, 7]
    assert list(_sampler(10, 1, 3, shuffle=False, drop_last=False)) == [1, 4, 7, 0]


@pytest.mark.parametrize(("n", "world"), [(20, 2), (23, 3), (7, 4), (5, 1), (2, 3)])
def test_drop_last_ranks_disjoint_and_cover_once(n: int, world: int) -> None:
    shards = [list(_sampler(n, r, world, seed=1)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // world) * world
    assert set(flat) <= set(range(n))
    if n % world == 0:
        assert sorted(flat) == list(range(n))


@pytest.mark.parametrize(("n", "world"), [(20, 2), (23, 3), (7, 4), (2, 3), (1, 4), (3, 8)])
def test_padding_covers_everything(n: int, world: int) -> None:
    shards = [list(_sampler(n, r, world, seed=1, drop_last=False)) for r in range(world)]
    per_rank = -(-n // world)
    assert all(len(s) == per_rank for s in shards)
    counts = Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) == per_rank * world
    assert max(counts.values()) - min(counts.values()) <= 1 or n < world


def test_sampler_consumed_skips_own_share() -> None:
    full = list(_sampler(23, 2, 3, seed=5))
    part = _sampler(23, 2, 3, seed=5, consumed_samples=9)
    assert list(part) == full[3:]
    assert len(part) == len(full) - 3


def test_empty_dataset() -> None:
    assert list(_sampler(0, 0, 2)) == []
    loader = _loader(0, 0, 2)
    assert _batches(loader) == []
    assert len(loader) == 0


# --- loader: resume exactness -----------------------------------------------------------


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_resume_equals_uninterrupted_epoch(world: int, drop_last: bool) -> None:
    n, bs = 23, 2
    epoch_size = _sampler(n, 0, world, drop_last=drop_last).total_size
    for rank in range(world):
        reference = _batches(_loader(n, rank, world, bs, drop_last=drop_last))
        assert reference, "the epoch must have batches for this test to mean anything"
        for k in range(len(reference) + 1):
            first = _loader(n, rank, world, bs, drop_last=drop_last)
            head = _batches(first, k)
            state = first.state_dict()
            assert state["epoch"] == 0
            resumed = _loader(n, rank, world, bs, drop_last=drop_last)
            resumed.load_state_dict(state)
            if state["consumed_samples"] == epoch_size:  # finished: resume starts epoch 1
                assert head == reference
                assert _batches(resumed)[0] != reference[0]
                assert resumed.epoch == 1
                continue
            assert len(resumed) == len(reference) - k
            assert head + _batches(resumed) == reference, (rank, k)


def test_resume_across_ranks_reassembles_the_global_epoch() -> None:
    world, n, bs = 3, 30, 2
    order = _sampler(n, 0, 1, seed=7).epoch_indices()
    states = []
    for rank in range(world):
        loader = _loader(n, rank, world, bs)
        _batches(loader, 2)
        states.append(loader.state_dict())
    assert all(s == {"epoch": 0, "consumed_samples": 2 * bs * world} for s in states)
    rest = []
    for rank in range(world):
        loader = _loader(n, rank, world, bs)
        loader.load_state_dict(states[rank])
        rest.append([i for b in _batches(loader) for i in b])
    assert sorted(i for r in rest for i in r) == sorted(order[2 * bs * world :])


def test_workers_prefetch_does_not_advance_state() -> None:
    n, world, rank, bs, k = 40, 2, 1, 2, 3
    reference = _batches(_loader(n, rank, world, bs))
    loader = _loader(n, rank, world, bs, num_workers=2)
    head = _batches(loader, k)  # workers have prefetched well beyond k batches by now
    state = loader.state_dict()
    assert state == {"epoch": 0, "consumed_samples": k * bs * world}
    resumed = _loader(n, rank, world, bs, num_workers=2)
    resumed.load_state_dict(state)
    assert head + _batches(resumed) == reference
    # A new iter() on the same loader also continues right after the last consumed batch.
    assert head + _batches(loader) == reference


def test_consumed_samples_argument_matches_load_state_dict() -> None:
    reference = _batches(_loader(24, 0, 2, 3))
    assert _batches(_loader(24, 0, 2, 3, consumed_samples=12)) == reference[2:]


def test_completion_counts_dropped_tail() -> None:
    loader = _loader(23, 0, 2, 3)  # 11 samples per rank -> 3 batches, 2 dropped
    assert len(_batches(loader)) == 3
    assert loader.state_dict() == {"epoch": 0, "consumed_samples": 22}


def test_partial_last_batch_is_counted_once() -> None:
    loader = _loader(23, 0, 2, 3, drop_last=False)  # 12 per rank -> 4 batches of 3
    _batches(loader, 4)
    assert loader.state_dict() == {"epoch": 0, "consumed_samples": 24}
    loader = _loader(22, 0, 2, 3, drop_last=False)  # 11 per rank -> 3 + 3 + 3 + 2
    _batches(loader, 4)
    assert loader.state_dict() == {"epoch": 0, "consumed_samples": 22}


# --- loader: epoch rule -----------------------------------------------------------------


def _epoch_reference(epoch: int, n: int = 20, world: int = 2) -> list[list[int]]:
    loader = _loader(n, 0, world)
    loader.set_epoch(epoch)
    return _batches(loader)


def test_finished_epoch_advances_on_next_iter() -> None:
    loader = _loader(20, 0, 2)
    seen = [_batches(loader) for _ in range(3)]
    assert seen == [_epoch_reference(e) for e in range(3)]
    assert len({json.dumps(s) for s in seen}) == 3
    assert loader.state_dict() == {"epoch": 2, "consumed_samples": 20}
    assert len(loader) == 5  # the next iter() starts epoch 3 from the top


def test_unfinished_epoch_does_not_advance() -> None:
    loader = _loader(20, 0, 2)
    head = _batches(loader, 2)
    assert head + _batches(loader) == _epoch_reference(0)
    assert loader.epoch == 0


def test_loading_a_finished_state_starts_next_epoch() -> None:
    loader = _loader(20, 0, 2)
    loader.load_state_dict({"epoch": 4, "consumed_samples": 20})
    assert _batches(loader) == _epoch_reference(5)


def test_set_epoch_overrides() -> None:
    loader = _loader(20, 0, 2)
    _batches(loader)
    loader.set_epoch(0)  # replay epoch 0 instead of advancing
    assert _batches(loader) == _epoch_reference(0)
    loader.set_epoch(3, consumed_samples=4)
    assert _batches(loader) == _epoch_reference(3)[1:]
    assert loader.state_dict() == {"epoch": 3, "consumed_samples": 20}


def test_stale_iterator_raises() -> None:
    loader = _loader(20, 0, 2)
    old = iter(loader)
    next(old)
    _ = iter(loader)
    with pytest.raises(RuntimeError, match="stale"):
        next(old)


# --- state dict -------------------------------------------------------------------------


def test_state_dict_is_plain_ints_and_json_round_trips(tmp_path: Any) -> None:
    loader = _loader(20, 1, 2)
    _batches(loader, 3)
    state = loader.state_dict()
    assert all(type(v) is int for v in state.values())
    assert json.loads(json.dumps(state)) == state
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == state
    fresh = _loader(20, 1, 2)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state


# --- bad inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [-1, 2])
def test_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank={rank} is out of range.*\[0, 1\]"):
        _sampler(10, rank, 2)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_replicas=0"):
        _sampler(10, 0, 0)
    with pytest.raises(ValueError, match="dataset_len=-1"):
        _sampler(-1, 0, 1)
    with pytest.raises(ValueError, match="epoch=-1"):
        _sampler(10, 0, 1).set_epoch(-1)


def test_consumed_not_multiple_of_replicas() -> None:
    with pytest.raises(ValueError, match="consumed_samples=5 is not a multiple of num_replicas=2"):
        _sampler(10, 0, 2, consumed_samples=5)
    loader = _loader(10, 0, 3)
    with pytest.raises(ValueError, match="not a multiple of num_replicas=3"):
        loader.load_state_dict({"epoch": 0, "consumed_samples": 4})


@pytest.mark.parametrize("consumed", [-2, 12])
def test_consumed_outside_epoch(consumed: int) -> None:
    with pytest.raises(ValueError, match=rf"consumed_samples={consumed} is outside \[0, 10\]"):
        _sampler(11, 0, 2, consumed_samples=consumed)


def test_bad_state_dict_keys() -> None:
    loader = _loader(10, 0, 2)
    with pytest.raises(KeyError, match=r"missing keys \['consumed_samples'\]"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(KeyError, match=r"unexpected keys \['step'\]"):
        loader.load_state_dict({"epoch": 0, "consumed_samples": 0, "step": 1})
    with pytest.raises(TypeError, match=r"'epoch'=1\.5 must be an int"):
        loader.load_state_dict({"epoch": 1.5, "consumed_samples": 0})


def test_bad_state_leaves_loader_unchanged() -> None:
    loader = _loader(10, 0, 2)
    _batches(loader, 1)
    before = loader.state_dict()
    with pytest.raises(ValueError, match="outside"):
        loader.load_state_dict({"epoch": 1, "consumed_samples": 100})
    assert loader.state_dict() == before


def test_batch_size_zero() -> None:
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        build_dataloader(_Range(10), 0, num_replicas=1, rank=0)


def test_sampler_must_match_dataset() -> None:
    with pytest.raises(ValueError, match=r"len\(dataset\)=10 but sampler.dataset_len=12"):
        ResumableDataLoader(_Range(10), sampler=_sampler(12, 0, 1), batch_size=2)


def test_iterable_dataset_rejected() -> None:
    with pytest.raises(TypeError, match="map-style"):
        build_dataloader(_Stream(), 2, num_replicas=1, rank=0)


def test_iterating_does_not_consume_the_global_torch_rng() -> None:
    loader = build_dataloader(list(range(16)), 2, num_replicas=1, rank=0, seed=3)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(2):
        next(iter(loader))
    assert torch.equal(torch.rand(3), expected)
