"""`EngineBase`: the lifecycle every adapter shares (HF, vLLM, SGLang, and lightrft-testing's
``FakeEngine``), so that each adapter holds only what its engine does differently.

The base keeps the :class:`~lightrft.engines.protocol.SleepState`, the weight version and
whether the engine is shut down, and runs the protocol's ``sleep``, ``wake_up`` and
``shutdown`` around three steps an adapter overrides:

* :meth:`EngineBase._release` — free memory for a sleep at ``level`` (the state has
  already moved; if this raises, the state is put back);
* :meth:`EngineBase._resume` — bring back what ``tags`` name, told what slept before;
* :meth:`EngineBase._close` — stop the engine, called once.

An adapter calls :meth:`EngineBase._check_open` first in its own calls and
:meth:`EngineBase._synced` when a weight sync has landed (``complete=False`` for a
partial one); one that serves LoRA
adapters calls :meth:`EngineBase._check_adapter_rank` before loading one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightrft.engines.capabilities import KeepsSleepState, WeightVersion
from lightrft.engines.protocol import EngineError, SleepState

__all__ = ["EngineBase"]


class EngineBase(KeepsSleepState, WeightVersion):
    """The shared lifecycle; see the module docstring.

    Args:
        supports_sleep: whether :meth:`sleep` and :meth:`wake_up` free and restore memory
            (an engine that cannot sleep refuses both, naming itself).
    """

    supports_sleep: bool

    def __init__(self, supports_sleep: bool) -> None:
        self.supports_sleep = supports_sleep
        self.state = SleepState(supports_sleep=supports_sleep)
        self._weight_version = 0
        self._closed = False

    @property
    def weight_version(self) -> int:
        """How many weight syncs have landed, partial ones included (every output
        carries it)."""
        return self._weight_version

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called; every call but ``shutdown`` then raises."""
        return self._closed

    def sleep(self, level: int = 1) -> None:
        self._check_open()
        with self.state.rollback_on_error():
            self.state.sleep(level)
            self._release(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        asleep = self.state.asleep_tags()
        level = self.state.level
        with self.state.rollback_on_error():
            self.state.wake_up(tags)
            self._resume(tags, asleep, level)

    def shutdown(self) -> None:
        """Stop the engine; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._close()

    # -- for adapters --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the engine was shut down ({type(self).__name__})")

    def _check_adapter_rank(
        self, settings: Mapping[str, Any], built_for: int | None, started: str
    ) -> None:
        """Raise naming the fix unless the engine was built for adapters of the rank in
        ``settings`` (``built_for``: the largest rank it serves, None: no adapters);
        ``started`` says how it was built (``"vLLM was built"``)."""
        rank = int(settings.get("r", 0))
        if built_for is None or rank > built_for:
            how = "without adapters" if built_for is None else f"for rank <= {built_for}"
            raise EngineError(
                f"{started} {how}, and the adapter has rank {rank}: set lora_sync='adapter' "
                "and lora_rank in the config before setup_inference_engine, so the engine "
                "is built to serve it"
            )

    def _synced(self, complete: bool = True) -> None:
        """A sync landed and the version moves on: a whole one (the weights are fresh),
        or with ``complete=False`` some weights, the rest kept (fresh unless a level-2
        sleep discarded the rest)."""
        self._weight_version += 1
        self.state.weights_synced(complete)

    def _release(self, level: int) -> None:
        """Free the engine's memory for a sleep at ``level`` (nothing by default)."""

    def _resume(self, tags: Sequence[str] | None, asleep: Sequence[str], level: int | None) -> None:
        """Bring back what ``tags`` (None: everything) name; ``asleep`` slept before the
        call, after a sleep at ``level`` (nothing by default)."""

    def _close(self) -> None:
        """Stop the engine and free what it holds (nothing by default); called once."""
