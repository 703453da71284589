"""What the engine calls share: the engine-side modules (imported on first use, with
the error naming the extra), the capability lookups, and :class:`EngineHost`, the state
the calls keep on the strategy and what they need from it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig

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


def _is_engine_source(obj: Any) -> bool:
    """What an engine is built from (None: the strategy's config; a mapping, an argparse
    namespace, a config or an EngineSpec, recognised by ``engine_type``/``pretrain``),
    as opposed to an engine object, checked against the protocol."""
    if obj is None or isinstance(obj, Mapping):
        return True
    if callable(getattr(obj, "generate", None)):
        return False
    return hasattr(obj, "engine_type") or hasattr(obj, "pretrain")


class EngineHost:
    """The engine calls' state on the strategy, and (for the type checker) what they
    use of :class:`~lightrft.strategy.StrategyBase`."""

    inference_engine: Any = None
    _engine_group: Any = None
    _engine_group_ranks: tuple[int, ...] = (0,)
    #: For an engine that keeps no SleepState: the wake-up tags of what the strategy
    #: itself put to sleep (so its engine calls wake what they slept, and only that).
    _slept_tags: frozenset[str] = frozenset()
    _warned_no_sleep: bool = False

    if TYPE_CHECKING:  # provided by StrategyBase
        config: StrategyConfig
        device: torch.device

        def get_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        def unwrap_model(self, model: nn.Module) -> nn.Module: ...

        def _require_setup(self, what: str) -> None: ...

        def _sizes(self) -> StrategyConfig: ...

    def _require_engine(self, what: str) -> Any:
        self._require_setup(what)
        if self.inference_engine is None:
            raise RuntimeError(f"{what} needs strategy.setup_inference_engine(...) first")
        return self.inference_engine
