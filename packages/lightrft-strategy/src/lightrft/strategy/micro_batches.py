"""One step's samples split into micro-batches: under a token budget, or fixed.

:meth:`lightrft.strategy.StrategyBase.plan_micro_batches` gathers every rank's sample
lengths (a list of ints per rank) and every rank computes the same plan from them:

* **Token budget** (``packing_samples`` with ``max_tokens_per_gpu``): each rank packs
  its samples into micro-batches of at most ``max_tokens_per_gpu`` tokens, and every
  data-parallel rank runs the **same number** of micro-batches. FSDP2 and ZeRO-3 run
  collectives inside every forward and backward, so a rank that ran one micro-batch
  fewer would leave the others waiting forever. The number is the smallest that fits
  every rank's samples under the budget; each rank then splits its samples into that
  many micro-batches with the Karmarkar-Karp largest differencing method
  (:func:`karmarkar_karp`), which balances the token counts of the parts much better
  than sorting and dealing round-robin, so the micro-batches of a rank cost about the
  same (verl balances its dynamic micro-batches the same way). A rank with fewer
  samples than micro-batches runs empty micro-batches (a one-token row with no loss
  tokens), which take part in the collectives and add nothing to the gradient.
  A sample longer than the budget cannot be split: it runs alone in its own
  micro-batch, with a warning naming its length (an error would end a run for one
  long rollout; the budget is a memory target, and a lone sample is the least that can
  run). Samples stay on the rank that holds them: each rank's experience is where it
  was generated, and moving it would cost more than the imbalance it removes at the
  batch sizes here.
* **Fixed** (no budget): micro-batches of ``micro_train_batch_size`` consecutive
  samples, as upstream's trainers cut them; a rank with fewer samples than the others
  also runs empty micro-batches to match.

Either way the plan sets the accumulation of the step: ``backward`` and
``optimizer_step`` step the optimizer exactly once, after the plan's last
micro-batch. And :meth:`StepPlan.loss` normalises each micro-batch's loss so the
step's gradient is that of the whole step's loss, whatever the split
(``loss_agg_mode``):

* ``token-mean``: the sum of the per-token losses over every loss token of the step
  on every rank, divided by their number;
* ``seq-mean-token-mean``: each sample's mean over its loss tokens, summed over the
  step's samples (those with loss tokens) on every rank, divided by their number.

The backends average gradients over the ranks and ``backward`` divides by the number
of micro-batches; the plan's scale ``micro-batches x ranks / total`` undoes both.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from types import TracebackType

    from lightrft.strategy.packing import TrainBatch
    from lightrft.strategy.world import World

logger = logging.getLogger(__name__)

__all__ = ["LossAggregation", "PlanError", "StepPlan", "karmarkar_karp", "split_step"]

LossAggregation = Literal["token-mean", "seq-mean-token-mean"]


class PlanError(RuntimeError):
    """A step's micro-batches were not run as planned."""


def karmarkar_karp(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Split the indices of ``weights`` into ``parts`` lists whose weight sums are
    balanced, by the largest differencing method: every item starts as a partial
    partition of its own; the two partial partitions with the largest spread are merged,
    the heaviest part of one with the lightest of the other, until one is left. Each
    list is in ascending index order; the lists are heaviest first. Deterministic."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one part")
    # heap entries: (-spread, tie-break, sums, members), parts sorted heaviest first
    heap: list[tuple[int, int, list[int], list[list[int]]]] = []
    for index, weight in enumerate(weights):
        sums = [int(weight)] + [0] * (parts - 1)
        members: list[list[int]] = [[index]] + [[] for _ in range(parts - 1)]
        heapq.heappush(heap, (-int(weight), index, sums, members))
    if not heap:
        return [[] for _ in range(parts)]
    counter = len(weights)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        # heaviest of a with lightest of b (both are kept heaviest first)
        merged = sorted(
            (
                (sums_a[i] + sums_b[parts - 1 - i], members_a[i] + members_b[parts - 1 - i])
                for i in range(parts)
            ),
            key=lambda pair: -pair[0],
        )
        sums = [s for s, _ in merged]
        members = [m for _, m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, members))
        counter += 1
    _, _, sums, members = heap[0]
    return [sorted(m) for m in members]


def _split_rank(lengths: Sequence[int], budget: int, count: int) -> list[list[int]] | None:
    """``lengths`` in ``count`` micro-batches under ``budget`` (a longer sample alone in
    its own), or None when they do not fit."""
    over = [i for i, n in enumerate(lengths) if n > budget]
    rest = [i for i, n in enumerate(lengths) if n <= budget]
    if len(over) > count or (rest and len(over) == count):
        return None
    parts = [[i] for i in over]
    if count > len(over):
        split = karmarkar_karp([lengths[i] for i in rest], count - len(over))
        if any(sum(lengths[rest[j]] for j in part) > budget for part in split):
            return None
        parts += [[rest[j] for j in part] for part in split]
    return parts


def split_step(
    lengths_by_rank: Sequence[Sequence[int]], budget: int | None, micro_batch_size: int
) -> list[list[list[int]]]:
    """Every rank's micro-batches (lists of its sample indices), the same number on
    each: under the token ``budget``, or of ``micro_batch_size`` consecutive samples
    when ``budget`` is None. Pure: every rank computes the same result."""
    if budget is None:
        count = max(1, *(math.ceil(len(r) / micro_batch_size) for r in lengths_by_rank))
        return [
            [
                list(range(start, min(start + micro_batch_size, len(r))))
                for start in range(0, count * micro_batch_size, micro_batch_size)
            ]
            for r in lengths_by_rank
        ]
    # the fewest micro-batches each rank needs on its own, then the largest of those
    # for every rank, more while some rank's samples do not fit
    count = 1
    for lengths in lengths_by_rank:
        over = sum(1 for n in lengths if n > budget)
        rest = sum(n for n in lengths if n <= budget)
        count = max(count, over + math.ceil(rest / budget))
    limit = max(1, *(len(r) for r in lengths_by_rank))
    while True:
        splits = [_split_rank(lengths, budget, count) for lengths in lengths_by_rank]
        if all(s is not None for s in splits):
            return [s for s in splits if s is not None]
        if count >= limit:  # every sample alone always fits
            raise AssertionError(f"no split of {lengths_by_rank} in {count} micro-batches")
        count += 1


@dataclass
class StepPlan:
    """One step's micro-batches on this rank, and the normalisation of their losses.

    Attributes:
        micro_batches: this rank's micro-batches, as indices into the lengths it passed
            (an empty list: an empty micro-batch that runs for the collectives).
        lengths: this rank's sample lengths, as passed.
        loss_tokens: this rank's loss tokens per sample, as passed (the lengths when
            none were).
        ranks: the ranks whose gradients the backend averages.
        total_tokens, total_samples: loss tokens, and samples with loss tokens, of the
            step on every rank.
        loss_agg_mode: ``token-mean`` or ``seq-mean-token-mean``.
        budget: the token budget, or None for fixed micro-batches.
        packed: whether the samples of a micro-batch are packed into one row.
    """

    micro_batches: list[list[int]]
    lengths: list[int]
    loss_tokens: list[int]
    ranks: int
    total_tokens: int
    total_samples: int
    loss_agg_mode: LossAggregation
    budget: int | None
    packed: bool
    finished: bool = False
    _world: Any = field(default=None, repr=False)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches every rank runs this step (the step's accumulation)."""
        return len(self.micro_batches)

    def tokens(self, index: int) -> int:
        """Tokens of micro-batch ``index`` (the sum of its samples' lengths)."""
        return sum(self.lengths[i] for i in self.micro_batches[index])

    def loss(self, token_loss: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """The loss to pass to ``strategy.backward`` for one micro-batch: ``token_loss``
        holds the per-token loss of each of ``batch``'s loss tokens (its
        ``token_sample`` order), aggregated by ``loss_agg_mode`` over the whole step
        and scaled so the step's accumulated, rank-averaged gradient is that of the
        step's loss. An empty micro-batch gives a zero still tied to the forward."""
        scale = self.num_micro_batches * self.ranks
        flat = token_loss.reshape(-1)
        if self.loss_agg_mode == "token-mean":
            return flat.sum() * (scale / max(self.total_tokens, 1))
        per_sample = torch.zeros(
            len(batch.samples), dtype=flat.dtype, device=flat.device
        ).index_add(0, batch.token_sample.to(flat.device), flat)
        counts = batch.sample_tokens.to(flat.device).clamp(min=1)
        return (per_sample / counts).sum() * (scale / max(self.total_samples, 1))

    def finish(self) -> None:
        """End the plan: the step's models must have run every micro-batch. Later
        ``backward``/``optimizer_step`` calls use the fixed accumulation again."""
        if self.finished:
            return
        self.finished = True
        world = self._world
        if world is None or world.plan is not self:
            return
        world.plan = None
        unfinished = world.step_states.unfinished()
        if unfinished:
            raise PlanError(
                f"the step planned in {self.num_micro_batches} micro-batches ended with "
                f"{unfinished} micro-step(s) run since the last optimizer step; call "
                "strategy.backward and strategy.optimizer_step once for every micro-batch "
                "in plan.micro_batches (empty ones too) before the plan ends"
            )

    def __enter__(self) -> StepPlan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is None:
            self.finish()
        else:  # do not hide the error with ours
            self.finished = True
            if self._world is not None and self._world.plan is self:
                self._world.plan = None


def make_plan(world: World, lengths: Sequence[int], loss_tokens: Sequence[int] | None) -> StepPlan:
    """This rank's plan from every rank's ``lengths`` (one collective)."""
    config = world.config
    lengths = [int(n) for n in lengths]
    loss_tokens = lengths if loss_tokens is None else [int(n) for n in loss_tokens]
    if len(loss_tokens) != len(lengths):
        raise ValueError(
            f"plan_micro_batches: {len(lengths)} lengths but {len(loss_tokens)} loss_tokens; "
            "pass one loss-token count per sample"
        )
    bad = [(i, n) for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise ValueError(
            f"plan_micro_batches: sample {bad[0][0]} has length {bad[0][1]}; every sample "
            "needs at least one token"
        )
    budget = config.max_tokens_per_gpu if config.packing_samples else None
    mine = (lengths, sum(loss_tokens), sum(1 for n in loss_tokens if n > 0))
    every = world.all_gather_object(mine)
    rank = world.get_rank()
    splits = split_step([e[0] for e in every], budget, config.micro_train_batch_size)
    over = [(i, n) for i, n in enumerate(lengths) if budget is not None and n > budget]
    if over:
        longest = max(over, key=lambda pair: pair[1])
        logger.warning(
            "rank %d: %d sample(s) over max_tokens_per_gpu=%s (the longest, sample %d, has %d "
            "tokens) run alone in their own micro-batches; raise max_tokens_per_gpu if one "
            "does not fit",
            rank,
            len(over),
            budget,
            longest[0],
            longest[1],
        )
    return StepPlan(
        micro_batches=splits[rank],
        lengths=lengths,
        loss_tokens=list(loss_tokens),
        ranks=len(every),
        total_tokens=sum(e[1] for e in every),
        total_samples=sum(e[2] for e in every),
        loss_agg_mode=config.loss_agg_mode,
        budget=budget,
        packed=config.packing_samples,
        _world=world,
    )
