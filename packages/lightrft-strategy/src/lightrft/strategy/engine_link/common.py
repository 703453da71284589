"""What the engine link's modules share: the engine-side modules (imported on first use,
with the error naming the extra), the capability lookups, and :class:`EngineSlot`, the
engine and its tensor-parallel group that the link's parts share."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


class EngineSlot:
    """The engine a link serves and its tensor-parallel group: what the link's parts
    (sleep, generation, weight sync) share. Set by ``EngineLink.attach``."""

    def __init__(self, world: World) -> None:
        self.world = world
        #: The rollout engine (None until ``setup_inference_engine``).
        self.engine: Any = None
        #: The process group of this rank's engine tensor-parallel group (None: alone).
        self.group: Any = None
        self.group_ranks: tuple[int, ...] = (0,)

    def require(self, what: str) -> Any:
        """The engine, once the strategy is set up and one is attached; else raises
        naming ``what``."""
        self.world.require_setup(what)
        if self.engine is None:
            raise RuntimeError(f"{what} needs strategy.setup_inference_engine(...) first")
        return self.engine
