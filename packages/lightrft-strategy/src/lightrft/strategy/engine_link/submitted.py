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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightrft.strategy.engine_link.common import weight_version

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
        in_flight = self.world.config.max_staleness >= 1 and callable(
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
            outputs = list(engine.collect())
            lag = self.lag(outputs)
            limit = self.world.config.max_staleness
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

    def lag(self, outputs: Sequence[Any]) -> int:
        """Optimizer steps between the trainer's weights now and the oldest weights
        that generated ``outputs`` (0 when the engine does not count its syncs).
        Collective over the ranks (the oldest version of any rank counts)."""
        engine = self.slot.engine
        now = weight_version(engine) if engine is not None else None
        if now is None:
            return 0
        model = self.weight_sync.last_model()
        if model is not None and self.weight_sync.trainer_ahead(model):
            now += 1  # trained since the last sync: the next sync's version
        versions = [int(getattr(o, "weight_version", now)) for o in outputs]
        oldest = min(versions, default=now)
        return int(self.world.all_reduce(now - oldest, "max"))
