"""Rollouts submitted ahead: a loop hands the next step's prompts over before it trains
on the current step, and collects them after, so that engine ranks of their own can
generate while the trainer trains (``engine_placement: separate``, ``max_staleness``).

The same loop runs on every placement; the strategy decides when generation happens:

* engine ranks of their own and ``max_staleness >= 1``: the engine ranks start at once,
  from the weights they hold, and the trainer goes on (one-step-off-policy when the
  loop syncs once per step). A rollout collected from weights more than
  ``max_staleness`` optimizer steps old is not used: the strategy syncs the newest
  weights and generates it again, waiting rather than exceeding the bound.
* otherwise (colocated engines, or ``max_staleness: 0``): nothing is generated at
  submission; :meth:`Submitted.collect` generates from the newest weights (it first
  sends the model last synced, when it changed since), as ``gather_and_generate`` would.

Every output carries the ``weight_version`` of the engine weights that generated it;
:meth:`Submitted.lag` is the trainer's weight version minus the oldest of them.

A checkpoint saved while rollouts are in flight collects them first (the trainer waits
for the engine ranks at that step) and holds them (:meth:`Submitted.hold`, see
:mod:`~lightrft.strategy.engine_link.held`); after ``load_ckpt`` the same prompts
submitted with the same sampling get those outputs back (:meth:`Submitted.restore`),
counted as old as they were, so a resumed one-step-off run trains on what the
uninterrupted run trained on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightrft.strategy.engine_link.common import weight_version
from lightrft.strategy.engine_link.held import outputs_from_plain, plain_outputs, request_key

if TYPE_CHECKING:
    from lightrft.strategy.engine_link.common import EngineSlot
    from lightrft.strategy.engine_link.generation import Generation
    from lightrft.strategy.engine_link.weight_sync import WeightSync
    from lightrft.strategy.world import World

logger = logging.getLogger("lightrft.strategy.engine_link")


class Submitted:
    """:meth:`submit` and :meth:`collect`: one step's prompts at a time."""

    def __init__(
        self, world: World, slot: EngineSlot, generation: Generation, weight_sync: WeightSync
    ) -> None:
        self.world = world
        self.slot = slot
        self.generation = generation
        self.weight_sync = weight_sync
        self._request: tuple[list[Any], Any, bool] | None = None
        self._in_flight = False
        #: outputs of the in-flight request already collected (for a checkpoint, or
        #: restored from one)
        self._ready: list[Any] | None = None
        #: restored outputs' age: (optimizer steps behind the checkpoint's weights, the
        #: model's weight-change count when the checkpoint was loaded)
        self._age: tuple[int, int] | None = None
        #: what a checkpoint held, until the resumed loop submits again: (held, changes)
        self._restored: tuple[dict[str, Any], int] | None = None

    @property
    def pending(self) -> bool:
        """Whether prompts are submitted and not yet collected."""
        return self._request is not None

    def submit(self, prompts: Sequence[Any], sampling: Any, sleep_engine: bool = False) -> None:
        """Hand this rank's ``prompts`` over (collective with :meth:`collect`'s rules:
        every rank submits, also with no prompts)."""
        engine = self.slot.require("submit_generation")
        if self._request is not None:
            raise RuntimeError(
                "submit_generation: the last submitted prompts were not collected; call "
                "strategy.collect_generation() first (one step is in flight at a time)"
            )
        if self._take_restored(prompts, sampling, sleep_engine):
            return
        in_flight = self.world.sizes.max_staleness >= 1 and callable(
            getattr(engine, "submit", None)
        )
        if in_flight:  # (a refused prompt raises here, on every rank: nothing is pending)
            engine.submit(list(prompts), sampling)
        self._request, self._in_flight = (list(prompts), sampling, sleep_engine), in_flight

    def collect(self) -> list[Any]:
        """This rank's outputs of the submitted prompts (``n`` per prompt, in order)."""
        if self._request is None:
            raise RuntimeError(
                "collect_generation: nothing was submitted; call "
                "strategy.submit_generation(prompts, sampling) first"
            )
        (prompts, sampling, sleep_engine), self._request = self._request, None
        engine = self.slot.require("collect_generation")
        if self._in_flight:
            ready, self._ready = self._ready, None
            outputs = list(engine.collect()) if ready is None else ready
            self._date_restored(outputs)
            lag = self.lag(outputs)
            limit = self.world.sizes.max_staleness
            if lag <= limit:
                return outputs
            logger.warning(
                "collect_generation: these rollouts come from weights %d optimizer "
                "step(s) old, more than max_staleness=%d: generating them again from the "
                "newest weights (submit once per optimizer step to keep them fresh)",
                lag,
                limit,
            )
        self._send_newest()
        return self.generation.generate(prompts, sampling, sleep_after=sleep_engine)

    def _send_newest(self) -> None:
        """Sync the model last synced when its weights changed since."""
        model = self.weight_sync.last_model()
        if model is not None and self.weight_sync.trainer_ahead(model):
            self.weight_sync.update_engine_weights(model, skip_unchanged=True)

    def hold(self) -> dict[str, Any] | None:
        """For a checkpoint: the rollouts in flight, collected now and kept for
        :meth:`collect`, as plain values (the request's key, this rank's outputs, and
        how many optimizer steps older than the trainer's weights their weights are).
        None when nothing is in flight. Collective."""
        if self._request is None or not self._in_flight:
            return None
        if self._ready is None:
            self._ready = list(self.slot.require("save_ckpt").collect())
        self._date_restored(self._ready)
        behind = self.lag(self._ready)
        outputs = plain_outputs(self._ready)
        if outputs is None:
            return None
        prompts, sampling, _ = self._request
        return {"request": request_key(prompts, sampling), "behind": behind, "outputs": outputs}

    def restore(self, held: dict[str, Any] | None, weight_changes: int) -> None:
        """Keep what :meth:`hold` gave (None: nothing) for the next :meth:`submit`;
        ``weight_changes`` is the model's count of weight changes as loaded."""
        self._restored = None if held is None else (held, weight_changes)
        if self._request is not None:  # the loop's own request is superseded by the load
            if self._in_flight and self._ready is None and self.slot.engine is not None:
                self.slot.engine.collect()  # the engine ranks' answers to it, dropped
            self._request, self._ready, self._age = None, None, None

    def _take_restored(self, prompts: Sequence[Any], sampling: Any, sleep_engine: bool) -> bool:
        """Whether the restored rollouts answer this submission (on every rank: the
        held request's key is this one's); they are then this request's outputs."""
        restored, self._restored = self._restored, None
        if restored is None:
            return False
        held, changes = restored
        same = held["request"] == request_key(prompts, sampling)
        if not int(self.world.all_reduce(int(same), "min")):
            logger.warning(
                "submit_generation: the prompts submitted after load_ckpt are not those in "
                "flight when the checkpoint was saved; they are generated now (submit the "
                "checkpoint's next prompts first to resume exactly)"
            )
            return False
        self._request, self._in_flight = (list(prompts), sampling, sleep_engine), True
        self._ready = outputs_from_plain(held["outputs"])
        self._age = (int(held["behind"]), changes)
        return True

    def _date_restored(self, outputs: Sequence[Any]) -> None:
        """Give restored outputs the weight version they have in this run: as many
        optimizer steps behind the trainer's weights as at the checkpoint, plus the
        steps trained since it was loaded."""
        if self._age is None:
            return
        (behind, changes), self._age = self._age, None
        model = self.weight_sync.last_model()
        since = self.weight_sync.weight_changes(model) - changes if model is not None else 0
        now = self._trainer_version()
        if now is None:
            return
        version = now - behind - max(since, 0)
        for output in outputs:
            output.weight_version = version

    def _trainer_version(self) -> int | None:
        """The weight version of the trainer's weights now: the engine's, plus one when
        the model last synced has trained since (the next sync's version)."""
        engine = self.slot.engine
        now = weight_version(engine) if engine is not None else None
        if now is None:
            return None
        model = self.weight_sync.last_model()
        if model is not None and self.weight_sync.trainer_ahead(model):
            now += 1  # trained since the last sync: the next sync's version
        return now

    def lag(self, outputs: Sequence[Any]) -> int:
        """Optimizer steps between the trainer's weights now and the oldest weights
        that generated ``outputs`` (0 when the engine does not count its syncs).
        Collective over the ranks (the oldest version of any rank counts)."""
        now = self._trainer_version()
        if now is None:
            return 0
        versions = [int(getattr(o, "weight_version", now)) for o in outputs]
        oldest = min(versions, default=now)
        return int(self.world.all_reduce(now - oldest, "max"))
