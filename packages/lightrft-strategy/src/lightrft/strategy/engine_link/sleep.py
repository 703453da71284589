"""Sleep and wake of the rollout engine: what the config asks, and what the engine's
:class:`~lightrft.engines.SleepState` says sleeps (or, for an engine that keeps none,
what the strategy itself put to sleep)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightrft.strategy.engine_link.common import (
    EngineHost,
    capabilities_module,
    logger,
    protocol_module,
)


class SleepCalls(EngineHost):
    """``maybe_sleep_inference_engine`` and ``wakeup_inference_engine`` (upstream's
    names), and the wake-ups the other engine calls make."""

    def maybe_sleep_inference_engine(self) -> bool:
        """Put the engine to sleep at ``engine_sleep_level`` when ``enable_engine_sleep``
        is set; returns whether it slept. A half-awake engine (a sync or generation was
        interrupted between its wake-ups) is woken whole first, then put to sleep."""
        level = self.config.sleep_level
        engine = self.inference_engine
        if level is None or engine is None:
            return False
        asleep = self._sleeping(None)
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
        if not self._keeps_state(engine):
            self._slept_tags = frozenset(protocol_module().WAKE_TAGS)
        return True

    def wakeup_inference_engine(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: both) when
        ``enable_engine_sleep`` is set: what its ``state`` says sleeps, or, for an engine
        that keeps no :class:`lightrft.engines.SleepState`, what is asked."""
        self._wake(tags, blind=True)

    @staticmethod
    def _keeps_state(engine: Any) -> bool:
        return isinstance(engine, capabilities_module().KeepsSleepState)

    def _sleeping(self, tags: Sequence[str] | None) -> list[str]:
        """Which of ``tags`` (None: all) sleep, in wake-up order: what the engine's
        SleepState says, or, for an engine that keeps none, what the strategy put to
        sleep. An unknown tag is kept, for the engine to refuse."""
        engine = self.inference_engine
        known = protocol_module().WAKE_TAGS
        if self._keeps_state(engine):
            asleep: list[str] = engine.state.asleep_tags()
        else:
            asleep = [t for t in known if t in self._slept_tags]
        if tags is None:
            return asleep
        return [t for t in tags if t in asleep or t not in known]

    def _wake_tags(self, asleep: Sequence[str]) -> None:
        """Wake ``asleep`` (every tag at once as None: the adapters' full wake-up)."""
        full = set(asleep) == set(protocol_module().WAKE_TAGS)
        self.inference_engine.wake_up(None if full else list(asleep))
        self._slept_tags = self._slept_tags - set(asleep)

    def _wake(self, tags: Sequence[str] | None, *, blind: bool) -> None:
        """Wake what sleeps of ``tags`` when sleep is enabled. ``blind``: an engine that
        keeps no SleepState gets the call as asked (the explicit call, for an engine
        put to sleep by someone else); otherwise such an engine is woken of what the
        strategy put to sleep (the engine calls' own wake-ups)."""
        engine = self.inference_engine
        if self.config.sleep_level is None or engine is None or not engine.supports_sleep:
            return
        if blind and not self._keeps_state(engine):
            engine.wake_up(tags)
            self._slept_tags = self._slept_tags - set(tags or protocol_module().WAKE_TAGS)
            return
        asleep = self._sleeping(tags)
        if asleep:
            self._wake_tags(asleep)
