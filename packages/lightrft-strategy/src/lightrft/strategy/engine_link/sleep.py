"""Sleep and wake of the rollout engine: what the config asks, and what the engine's
:class:`~lightrft.engines.SleepState` says sleeps (or, for an engine that keeps none,
what the strategy itself put to sleep)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightrft.strategy.engine_link.common import (
    EngineSlot,
    capabilities_module,
    logger,
    protocol_module,
)

if TYPE_CHECKING:
    from lightrft.strategy.world import World


class Sleep:
    """The engine's sleep and wake: :meth:`maybe_sleep` and :meth:`wake_up` (the link's
    ``maybe_sleep_inference_engine`` and ``wakeup_inference_engine``), and the wake-ups
    the other parts make (:meth:`wake`)."""

    def __init__(self, world: World, slot: EngineSlot) -> None:
        self.world = world
        self.slot = slot
        #: For an engine that keeps no SleepState: the wake-up tags of what the link
        #: itself put to sleep (so its calls wake what they slept, and only that).
        self._slept_tags: frozenset[str] = frozenset()
        self._warned_no_sleep = False

    def forget(self) -> None:
        """A new engine is attached: nothing of it was put to sleep by the link."""
        self._slept_tags = frozenset()
        self._warned_no_sleep = False

    def maybe_sleep(self) -> bool:
        """Put the engine to sleep at ``engine_sleep_level`` when ``enable_engine_sleep``
        is set; returns whether it slept. A half-awake engine (a sync or generation was
        interrupted between its wake-ups) is woken whole first, then put to sleep."""
        level = self.world.config.sleep_level
        engine = self.slot.engine
        if level is None or engine is None:
            return False
        asleep = self.sleeping(None)
        if asleep:
            if set(asleep) == set(protocol_module().WAKE_TAGS):
                return False  # already asleep (upstream's gather_and_generate sleeps after)
            self._wake_tags(asleep)
        if not engine.supports_sleep:
            if not self._warned_no_sleep:
                logger.warning(
                    "enable_engine_sleep is set but %s cannot sleep here; the strategy skips "
                    "sleeping (logged once)",
                    type(engine).__name__,
                )
                self._warned_no_sleep = True
            return False
        engine.sleep(level)
        if not self.keeps_state(engine):
            self._slept_tags = frozenset(protocol_module().WAKE_TAGS)
        return True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: both) when
        ``enable_engine_sleep`` is set: what its ``state`` says sleeps, or, for an engine
        that keeps no :class:`lightrft.engines.SleepState`, what is asked."""
        self.wake(tags, blind=True)

    @staticmethod
    def keeps_state(engine: Any) -> bool:
        """Whether ``engine`` keeps a :class:`lightrft.engines.SleepState`."""
        return isinstance(engine, capabilities_module().KeepsSleepState)

    def sleeping(self, tags: Sequence[str] | None) -> list[str]:
        """Which of ``tags`` (None: all) sleep, in wake-up order: what the engine's
        SleepState says, or, for an engine that keeps none, what the strategy put to
        sleep. An unknown tag is kept, for the engine to refuse."""
        engine = self.slot.engine
        known = protocol_module().WAKE_TAGS
        if self.keeps_state(engine):
            asleep: list[str] = engine.state.asleep_tags()
        else:
            asleep = [t for t in known if t in self._slept_tags]
        if tags is None:
            return asleep
        return [t for t in tags if t in asleep or t not in known]

    def _wake_tags(self, asleep: Sequence[str]) -> None:
        """Wake ``asleep`` (every tag at once as None: the adapters' full wake-up)."""
        full = set(asleep) == set(protocol_module().WAKE_TAGS)
        self.slot.engine.wake_up(None if full else list(asleep))
        self._slept_tags = self._slept_tags - set(asleep)

    def wake(self, tags: Sequence[str] | None, *, blind: bool) -> None:
        """Wake what sleeps of ``tags`` when sleep is enabled. ``blind``: an engine that
        keeps no SleepState gets the call as asked (the explicit call, for an engine
        put to sleep by someone else); otherwise such an engine is woken of what the
        strategy put to sleep (the engine calls' own wake-ups)."""
        engine = self.slot.engine
        if self.world.config.sleep_level is None or engine is None or not engine.supports_sleep:
            return
        if blind and not self.keeps_state(engine):
            engine.wake_up(tags)
            self._slept_tags = self._slept_tags - set(tags or protocol_module().WAKE_TAGS)
            return
        asleep = self.sleeping(tags)
        if asleep:
            self._wake_tags(asleep)
