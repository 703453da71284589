"""Where the engine calls lived before :mod:`lightrft.strategy.engine_link`; these names
stay importable from here."""

from lightrft.strategy.engine_link import (
    DEFAULT_BUCKET_BYTES,
    EngineLink,
    build_multimodal_inputs,
    is_engine,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "EngineLink", "build_multimodal_inputs", "is_engine"]
