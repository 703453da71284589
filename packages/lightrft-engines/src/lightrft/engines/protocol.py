"""The inference-engine protocol every adapter (vLLM, SGLang, HF, fake) implements.

Token ids in and out. A prompt is a list of token ids, or a dict with
``"prompt_token_ids"`` and, for multimodal models, ``"multi_modal_data"`` (e.g.
``{"image": [...]}``) as vLLM and SGLang take it.

Sleep/wake is a state machine with levels (:class:`SleepState`): level 1 moves the
weights off the accelerator and drops the KV cache; level 2 drops the weights too, so
they are stale until :meth:`InferenceEngine.update_weights` has sent every weight.
Waking is by tags: ``"weights"`` first, then sync, then ``"kv_cache"``. Generating
while anything is asleep, or with stale weights, raises instead of returning garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

Prompt = Sequence[int] | Mapping[str, Any]
WAKE_TAGS = ("weights", "kv_cache")


class EngineError(RuntimeError):
    """An engine call made in a state that does not allow it; the message says which."""


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it, the value and the range."""


@dataclass(frozen=True)
class SamplingParams:
    """Engine-neutral sampling parameters; each adapter translates them to its own.

    ``top_k=-1`` disables top-k; ``temperature=0`` is greedy decoding; ``seed`` makes
    sampling reproducible; ``native`` passes engine-specific parameters through
    unchanged (``{"repetition_penalty": 1.1}`` for vLLM, say).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    native: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks: list[tuple[str, Any, bool, str]] = [
            ("max_new_tokens", self.max_new_tokens, _int(self.max_new_tokens, 1), "an int >= 1"),
            ("temperature", self.temperature, _num(self.temperature, 0.0), "a number >= 0"),
            (
                "top_p",
                self.top_p,
                _num(self.top_p, 0.0) and 0.0 < self.top_p <= 1.0,
                "a number in (0, 1]",
            ),
            (
                "top_k",
                self.top_k,
                self.top_k == -1 or _int(self.top_k, 1),
                "-1 (off) or an int >= 1",
            ),
            ("n", self.n, _int(self.n, 1), "an int >= 1"),
            ("seed", self.seed, self.seed is None or _int(self.seed, 0), "None or an int >= 0"),
            (
                "stop_token_ids",
                self.stop_token_ids,
                all(_int(t, 0) for t in self.stop_token_ids),
                "token ids (ints >= 0)",
            ),
        ]
        for name, value, ok, accepted in checks:
            if not ok:
                raise SamplingError(
                    f"SamplingParams {name}={value!r} is invalid; accepted: {accepted}"
                )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _num(value: Any, low: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= low


@dataclass
class GenerationOutput:
    """One completion. ``finish_reason`` is ``"stop"`` (a stop token) or ``"length"``."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None


def prompt_token_ids(prompt: Prompt) -> list[int]:
    """The token ids of a prompt given as a list or as a dict."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" not in prompt:
            raise SamplingError(
                f"a dict prompt needs 'prompt_token_ids'; got keys {sorted(prompt)}"
            )
        ids = prompt["prompt_token_ids"]
    else:
        ids = prompt
    tokens = list(ids)
    if not tokens or not all(_int(t, 0) for t in tokens):
        raise SamplingError(f"a prompt is a non-empty list of token ids (ints >= 0); got {ids!r}")
    return tokens


class SleepState:
    """The sleep/wake state machine adapters share (and enforce the same way).

    Attributes:
        weights_awake, kv_awake: what is resident on the accelerator.
        weights_stale: set by a level-2 sleep; cleared by :meth:`weights_synced`.
    """

    def __init__(self, supports_sleep: bool = True) -> None:
        self.supports_sleep = supports_sleep
        self.weights_awake = True
        self.kv_awake = True
        self.weights_stale = False
        self.level: int | None = None

    @property
    def asleep(self) -> bool:
        return not (self.weights_awake and self.kv_awake)

    def sleep(self, level: int) -> None:
        if not self.supports_sleep:
            raise EngineError("this engine does not support sleep (supports_sleep is False)")
        if level not in (1, 2):
            raise EngineError(f"sleep level {level!r} is invalid; accepted: 1 or 2")
        if self.asleep:
            raise EngineError(f"the engine is already asleep (level {self.level}); wake it first")
        self.weights_awake = self.kv_awake = False
        self.level = level
        if level == 2:
            self.weights_stale = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        wanted = list(WAKE_TAGS if tags is None else tags)
        unknown = [t for t in wanted if t not in WAKE_TAGS]
        if unknown:
            raise EngineError(f"wake_up tags {unknown} are invalid; accepted: {list(WAKE_TAGS)}")
        if "weights" in wanted:
            self.weights_awake = True
        if "kv_cache" in wanted:
            self.kv_awake = True
        if not self.asleep:
            self.level = None

    def check_update(self) -> None:
        if not self.weights_awake:
            raise EngineError(
                "update_weights while the weights are asleep; call wake_up(['weights']) first"
            )

    def weights_synced(self) -> None:
        self.weights_stale = False

    def check_generate(self) -> None:
        if self.asleep:
            asleep = [
                t
                for t, awake in zip(WAKE_TAGS, (self.weights_awake, self.kv_awake), strict=True)
                if not awake
            ]
            raise EngineError(f"generate while {', '.join(asleep)} asleep; call wake_up() first")
        if self.weights_stale:
            raise EngineError(
                "generate with stale weights: a level-2 sleep discarded them; send the "
                "weights with update_weights (strategy.update_engine_weights) first"
            )


@runtime_checkable
class InferenceEngine(Protocol):
    """What a strategy needs from an inference engine."""

    #: Whether :meth:`sleep` / :meth:`wake_up` release and restore accelerator memory.
    supports_sleep: bool
    #: Whether every rank of a tensor-parallel group calls :meth:`generate` with the
    #: same prompts (vLLM's external launcher) or only the group's first rank (SGLang).
    generate_on_every_rank: bool

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """One output per prompt and sample (``n`` consecutive outputs per prompt)."""
        ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by the engine's parameter names; called once
        per bucket. The weights count as synced after :meth:`finish_weight_update`."""
        ...

    def finish_weight_update(self) -> None:
        """Every bucket of one sync has been sent."""
        ...

    def shutdown(self) -> None: ...
