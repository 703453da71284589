"""Where the engine calls lived before :mod:`lightrft.strategy.engine_link`: the names in
``__all__`` stay importable from here. ``InferenceEngineCalls``, the class that joined
the engine calls, is gone: :class:`~lightrft.strategy.engine_link.EngineLink` replaced
it, and importing it says so."""

from typing import Any

from lightrft.strategy.engine_link import (
    DEFAULT_BUCKET_BYTES,
    EngineLink,
    build_multimodal_inputs,
    is_engine,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "EngineLink", "build_multimodal_inputs", "is_engine"]


def __getattr__(name: str) -> Any:
    if name == "InferenceEngineCalls":
        raise ImportError(
            "lightrft.strategy.rollout.InferenceEngineCalls is gone: the strategy's engine "
            "calls are lightrft.strategy.engine_link.EngineLink (strategy.engine_link)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
