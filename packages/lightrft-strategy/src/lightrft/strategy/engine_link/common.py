"""What the engine link's modules share: the engine-side modules (imported on first use,
with the error naming the extra), the capability lookups, and :class:`EngineHost`, the
link's state and what it reads of the strategy."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.strategy.backend import Backend
    from lightrft.strategy.world import World

logger = logging.getLogger("lightrft.strategy.engine_link")


def protocol_module() -> Any:
    """:mod:`lightrft.engines.protocol`, or an ImportError naming the extra."""
    try:
        from lightrft.engines import protocol
    except ImportError as exc:
        raise ImportError(
            "inference-engine calls need lightrft-engines; install it with: "
            "pip install 'lightrft-strategy[engines]'"
        ) from exc
    return protocol


def capabilities_module() -> Any:
    """:mod:`lightrft.engines.capabilities`: what an engine offers is asked only through
    its protocols' ``isinstance`` checks."""
    protocol_module()  # the error naming the extra
    from lightrft.engines import capabilities

    return capabilities


def weight_version(engine: Any) -> int | None:
    """The engine's finished syncs, when it counts them."""
    return (
        engine.weight_version if isinstance(engine, capabilities_module().WeightVersion) else None
    )


def limits(engine: Any) -> tuple[int | None, int | None]:
    """The engine's (vocab_size, max_model_len); None where it does not know."""
    if isinstance(engine, capabilities_module().PromptLimits):
        return engine.vocab_size, engine.max_model_len
    return None, None


def is_engine(model: Any) -> bool:
    """Whether ``model`` is a rollout engine rather than a training model (upstream's
    test: it has ``wake_up``; here also ``generate``, as the protocol requires)."""
    return callable(getattr(model, "wake_up", None)) and callable(getattr(model, "generate", None))


class EngineHost:
    """The engine link's state, and what it is given: the strategy's
    :class:`~lightrft.strategy.world.World` (config, device, ranks, step counters) and
    its backend (for gathering full parameters); never the strategy itself."""

    def __init__(self, world: World, backend: Backend) -> None:
        self.world = world
        self.backend = backend
        #: The rollout engine (None until ``setup_inference_engine``).
        self.inference_engine: Any = None
        self._engine_group: Any = None
        self._engine_group_ranks: tuple[int, ...] = (0,)
        #: For an engine that keeps no SleepState: the wake-up tags of what the link
        #: itself put to sleep (so its calls wake what they slept, and only that).
        self._slept_tags: frozenset[str] = frozenset()
        self._warned_no_sleep = False
        #: LoRA models whose merged weights reached this engine in full once: later
        #: syncs send only what the adapter can change.
        self._synced_in_full: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: Per model: what the engine got at the last sync (the model's weight_changes,
        #: the engine's weight_version after it, the sync's renaming and dtype).
        self._engine_holds: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def config(self) -> StrategyConfig:
        return self.world.config

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def get_rank(self) -> int:
        return self.world.get_rank()

    def _weight_changes(self, model: nn.Module) -> int:
        """How often the strategy has changed ``model``'s weights (its StepState)."""
        return self.world.step_state(model).weight_changes

    def _require_engine(self, what: str) -> Any:
        self.world.require_setup(what)
        if self.inference_engine is None:
            raise RuntimeError(f"{what} needs strategy.setup_inference_engine(...) first")
        return self.inference_engine
