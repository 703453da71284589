"""Resumable, rank-aware data loading.

:func:`build_dataloader` returns a :class:`ResumableDataLoader` that shards a map-style
dataset over data-parallel ranks and can resume mid-epoch from a checkpoint:

    loader = build_dataloader(dataset, 4, num_replicas=world, rank=rank)
    loader.load_state_dict(checkpoint["dataloader"])  # optional
    for batch in loader: ...
    checkpoint["dataloader"] = loader.state_dict()  # {"epoch": int, "consumed_samples": int}

Epoch rule: once an epoch has been fully consumed, the next ``iter(loader)`` moves to
``epoch + 1`` from its start, so ``for epoch in ...: for batch in loader:`` needs no
``set_epoch`` call. An explicit :meth:`ResumableDataLoader.set_epoch` overrides this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

logger = logging.getLogger(__name__)

__all__ = ["ResumableDataLoader", "ResumableDistributedSampler", "build_dataloader"]

_STATE_KEYS = frozenset({"epoch", "consumed_samples"})


class ResumableDistributedSampler(Sampler[int]):
    """Shards ``range(dataset_len)`` over ranks and skips samples already consumed.

    Each epoch is a permutation from a ``torch.Generator`` seeded with ``seed + epoch``
    (identity order if not ``shuffle``), truncated (``drop_last``) or padded by repeating
    from its start to a multiple of ``num_replicas``; rank ``r`` gets ``order[r::num_replicas]``.

    Args:
        dataset_len: Number of samples in the dataset.
        num_replicas: Number of data-parallel ranks.
        rank: This rank, in ``[0, num_replicas)``.
        shuffle: Whether to permute the samples each epoch.
        seed: Base seed; all ranks must pass the same one.
        drop_last: Drop the tail that does not divide evenly instead of padding.
        consumed_samples: Samples already consumed in epoch 0, summed over all ranks.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        consumed_samples: int = 0,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1 (the data-parallel size)")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank} is out of range for num_replicas={num_replicas}; "
                f"pass a rank in [0, {num_replicas - 1}]"
            )
        if dataset_len < 0:
            raise ValueError(f"dataset_len={dataset_len} must be >= 0")
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        per_rank, rest = divmod(dataset_len, num_replicas)
        #: Samples each rank gets per epoch.
        self.num_samples = per_rank if drop_last or rest == 0 else per_rank + 1
        #: Samples per epoch over all ranks (after truncation or padding).
        self.total_size = self.num_samples * num_replicas
        self._epoch = self._consumed = 0
        self.set_epoch(0, consumed_samples)

    @property
    def epoch(self) -> int:
        """The current epoch (change it with :meth:`set_epoch`)."""
        return self._epoch

    @property
    def consumed_samples(self) -> int:
        """Samples of the current epoch already consumed, summed over all ranks."""
        return self._consumed

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        """Select the epoch to iterate and how many of its samples to skip.

        Args:
            epoch: Epoch number, >= 0; it seeds the permutation.
            consumed_samples: Samples of this epoch already consumed over all ranks: a
                multiple of ``num_replicas`` in ``[0, total_size]``.

        Raises:
            ValueError: If either value is out of range.
        """
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if not 0 <= consumed_samples <= self.total_size:
            raise ValueError(
                f"consumed_samples={consumed_samples} is outside [0, {self.total_size}], the "
                f"epoch size (dataset_len={self.dataset_len}, num_replicas={self.num_replicas}, "
                f"drop_last={self.drop_last}); was the checkpoint made with another dataset?"
            )
        if consumed_samples % self.num_replicas:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a multiple of "
                f"num_replicas={self.num_replicas}; it counts samples over all ranks, so resume "
                f"with the same number of data-parallel ranks the checkpoint was saved with"
            )
        self._epoch = epoch
        self._consumed = consumed_samples

    def epoch_indices(self) -> list[int]:
        """This rank's indices for the whole current epoch, ignoring consumed samples."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self._epoch)
            order: list[int] = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.drop_last:
            order = order[: self.total_size]
        elif order:
            padding = self.total_size - len(order)
            order += (order * -(-padding // len(order)))[:padding]
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # Snapshot now: later state changes must not alter an iteration in progress.
        return iter(self.epoch_indices()[self._consumed // self.num_replicas :])

    def __len__(self) -> int:
        """Samples this rank still has to yield in the current epoch."""
        return self.num_samples - self._consumed // self.num_replicas


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that records how far its epoch has been consumed.

    Only batches handed to the caller count (worker prefetching does not), so
    :meth:`state_dict` after ``k`` batches resumes exactly at batch ``k + 1``. A new
    ``iter()`` continues from the current position; if the epoch is fully consumed it
    starts ``epoch + 1`` instead. Starting a new iterator, :meth:`set_epoch` or
    :meth:`load_state_dict` makes an older, unfinished iterator raise ``RuntimeError``.
    Build it with :func:`build_dataloader`.

    Args:
        dataset: Map-style dataset of ``sampler.dataset_len`` samples.
        sampler: The sampler that shards ``dataset`` for this rank.
        batch_size, drop_last, collate_fn, pin_memory, num_workers: As for
            :func:`build_dataloader`.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        sampler: ResumableDistributedSampler,
        batch_size: int,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        num_workers: int = 0,
    ) -> None:
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(f"sampler must be a ResumableDistributedSampler, got {sampler!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1 (the per-rank micro batch)")
        if isinstance(dataset, Sized) and len(dataset) != sampler.dataset_len:
            raise ValueError(
                f"len(dataset)={len(dataset)} but sampler.dataset_len={sampler.dataset_len}; "
                "build the sampler for this dataset (build_dataloader does)"
            )
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            num_workers=num_workers,
            # DataLoader draws its workers' base seed at every iter(); from its own
            # generator that draw leaves the global torch RNG alone, so a resumed run
            # (which calls iter() once more) keeps the RNG stream of an unbroken one.
            generator=torch.Generator().manual_seed(sampler.seed * 1_000_003 + sampler.rank),
        )
        self._sampler = sampler
        self._micro_batch_size = batch_size
        self._generation = 0

    def _epoch_finished(self) -> bool:
        return self._sampler.consumed_samples == self._sampler.total_size > 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._epoch_finished():
            logger.debug("epoch %d fully consumed; starting the next one", self.epoch)
            self._sampler.set_epoch(self.epoch + 1)
        self._generation += 1
        start = self._sampler.consumed_samples // self._sampler.num_replicas
        return self._track(super().__iter__(), self._generation, start)

    def _track(self, base: Iterator[Any], generation: int, start: int) -> Iterator[Any]:
        s = self._sampler
        per_rank = start
        for batch in base:
            self._check_current(generation)
            per_rank = min(per_rank + self._micro_batch_size, s.num_samples)
            s.set_epoch(s.epoch, per_rank * s.num_replicas)
            yield batch
        self._check_current(generation)
        # Also covers a last incomplete batch dropped by drop_last.
        s.set_epoch(s.epoch, s.total_size)

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError(
                "this ResumableDataLoader iterator is stale: iter(), set_epoch() or "
                "load_state_dict() was called after it was created; use a fresh iter(loader)"
            )

    def __len__(self) -> int:
        """Batches the next ``iter()`` will yield (after any automatic epoch advance)."""
        s = self._sampler
        remaining = s.num_samples if self._epoch_finished() else len(s)
        full, rest = divmod(remaining, self._micro_batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    @property
    def epoch(self) -> int:
        """The sampler's current epoch."""
        return self._sampler.epoch

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        """Select the epoch (and global samples already consumed) the next ``iter()`` uses.

        See :meth:`ResumableDistributedSampler.set_epoch` for the arguments.
        """
        self._sampler.set_epoch(epoch, consumed_samples)
        self._generation += 1

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "consumed_samples"}`` as plain ints (JSON-safe)."""
        return {"epoch": int(self.epoch), "consumed_samples": int(self._sampler.consumed_samples)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues right after it.

        Raises:
            KeyError: If keys are missing or unexpected.
            TypeError: If a value is not an int.
            ValueError: If a value does not fit this loader (see :meth:`set_epoch`).
        """
        missing, extra = _STATE_KEYS - state.keys(), state.keys() - _STATE_KEYS
        if missing or extra:
            raise KeyError(
                f"bad dataloader state: missing keys {sorted(missing)}, unexpected keys "
                f"{sorted(extra)}; expected exactly {sorted(_STATE_KEYS)} from state_dict()"
            )
        for key in sorted(_STATE_KEYS):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"dataloader state {key!r}={value!r} must be an int")
        self.set_epoch(state["epoch"], state["consumed_samples"])
        logger.info("data resumes at epoch %(epoch)d after %(consumed_samples)d samples", state)


def build_dataloader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    num_replicas: int,
    rank: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
    num_workers: int = 0,
    consumed_samples: int = 0,
) -> ResumableDataLoader:
    """Build a resumable loader of ``batch_size`` samples per rank over ``dataset``.

    Args:
        dataset: Map-style dataset with ``__len__`` (not an ``IterableDataset``).
        batch_size: Per-rank micro batch size, >= 1.
        num_replicas: Data-parallel world size.
        rank: Data-parallel rank of this process.
        shuffle: Permute samples each epoch (seeded by ``seed + epoch``).
        seed: Base seed, the same on every rank.
        drop_last: Drop the uneven tail when sharding and the last incomplete batch;
            if False, pad shards by repeating samples and keep the incomplete batch.
        collate_fn: Merges a list of samples into a batch (torch's default if None).
        pin_memory: Copy batches into pinned memory.
        num_workers: Loader worker processes.
        consumed_samples: Samples of epoch 0 already consumed over all ranks.

    Returns:
        The loader; its sampler is a :class:`ResumableDistributedSampler`.

    Raises:
        TypeError: If ``dataset`` is iterable-style or has no length.
        ValueError: If a size, rank or count is out of range.
    """
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise TypeError(
            f"dataset {type(dataset).__name__} must be a map-style Dataset with __len__ and "
            "__getitem__; IterableDataset cannot be sharded or resumed by index"
        )
    sampler = ResumableDistributedSampler(
        len(dataset),
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        consumed_samples=consumed_samples,
    )
    return ResumableDataLoader(
        dataset,
        sampler=sampler,
        batch_size=batch_size,
        drop_last=drop_last,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        num_workers=num_workers,
    )
