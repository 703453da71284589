"""lightrft.engines: inference engines for LightRFT rollouts behind one protocol.

``build_engine(config)`` builds the engine a ``StrategyConfig`` or upstream args
namespace selects (``engine_type``: ``hf``, ``vllm``, or a registered name); the
adapters import their engine package only when selected. See the package README.
"""

from importlib.metadata import version as _version

from lightrft.engines.base import EngineBase
from lightrft.engines.capabilities import (
    AdapterSync,
    ComputeDtype,
    KeepsSleepState,
    PartialWeightSync,
    PromptLimits,
    TensorParallel,
    WeightShapes,
    WeightStreaming,
    WeightVersion,
)
from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    InferenceEngine,
    Prompt,
    PromptError,
    SamplingError,
    SamplingParams,
    SleepState,
    WeightMismatchError,
    as_sampling_params,
    check_prompts,
    check_weight_shapes,
    prompt_token_ids,
)
from lightrft.engines.registry import (
    UnknownEngineError,
    available_engines,
    build_engine,
    get_engine_factory,
    register_engine,
    unregister_engine,
)
from lightrft.engines.spec import EngineSpec

__version__ = _version("lightrft-engines")

__all__ = [
    "AdapterSync",
    "ComputeDtype",
    "EngineBase",
    "EngineError",
    "EngineSpec",
    "GenerationOutput",
    "InferenceEngine",
    "KeepsSleepState",
    "PartialWeightSync",
    "Prompt",
    "PromptError",
    "PromptLimits",
    "SamplingError",
    "SamplingParams",
    "SleepState",
    "TensorParallel",
    "UnknownEngineError",
    "WeightMismatchError",
    "WeightShapes",
    "WeightStreaming",
    "WeightVersion",
    "__version__",
    "as_sampling_params",
    "available_engines",
    "build_engine",
    "check_prompts",
    "check_weight_shapes",
    "get_engine_factory",
    "prompt_token_ids",
    "register_engine",
    "unregister_engine",
]
