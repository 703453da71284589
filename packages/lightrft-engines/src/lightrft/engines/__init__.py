"""lightrft.engines: the inference-engine protocol (adapters for vLLM, SGLang and HF
``generate`` are to come; see the package README)."""

from importlib.metadata import version as _version

from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    InferenceEngine,
    Prompt,
    SamplingError,
    SamplingParams,
    SleepState,
    prompt_token_ids,
)

__version__ = _version("lightrft-engines")

__all__ = [
    "EngineError",
    "GenerationOutput",
    "InferenceEngine",
    "Prompt",
    "SamplingError",
    "SamplingParams",
    "SleepState",
    "__version__",
    "prompt_token_ids",
]
