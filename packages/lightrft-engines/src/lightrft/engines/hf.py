"""The Hugging Face engine: a transformers causal LM generating in the training process.

No server, no extra memory pool: batched ``generate`` with left padding on one device,
greedy or seeded sampling, ``n`` samples per prompt, stop token ids, logprobs of the
sampled tokens (from the raw logits). It is the engine where vLLM is absent, and the
reference the other engines are tested against. It does not shard (``engine_tp_size``
must be 1: each rank holds a full copy).

Vision-language models (a config with ``vision_config``) load with
``AutoModelForImageTextToText``; a prompt's images and videos go through the model's
own processors (:mod:`.hf_vision`), one prompt (its ``n`` samples) per ``generate``
call. A prompt with media for a text-only model is refused, never served without them.

Weight sync: ``update_weights`` checks each tensor's name and shape and stages a copy;
``finish_weight_update`` checks nothing is missing and only then copies every staged
tensor into the model, so a mismatched sync leaves the previous weights in place.
Sleep: level 1 moves the weights to CPU memory (a no-op on a CPU engine), level 2 also
marks them stale, so generation refuses until the next sync.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightrft.engines.base import EngineBase
from lightrft.engines.capabilities import PartialWeightSync, PromptLimits, WeightShapes
from lightrft.engines.multimodal import prompt_media
from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    Prompt,
    PromptError,
    as_sampling_params,
    check_prompts,
    check_weight_shapes,
)
from lightrft.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

#: ``(token_ids, media, where) -> (expanded_ids, model_kwargs)``: see :mod:`.hf_vision`.
MediaProcessor = Callable[
    [Sequence[int], Mapping[str, Sequence[Any]], str], tuple[list[int], dict[str, torch.Tensor]]
]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the hf engine needs transformers: pip install 'lightrft-engines[hf]'"
        ) from exc
    return transformers


class HFEngine(EngineBase, PromptLimits, WeightShapes, PartialWeightSync):
    """A causal LM from transformers as an inference engine.

    Args:
        model: a transformers causal LM (``generate`` and ``config``) to serve; it is
            used in place (put it on ``device`` first, or let the engine move it).
        device: where generation runs.
        max_model_len: prompt + new tokens limit (default: the model's
            ``max_position_embeddings``).
        max_batch_size: rows (prompts x n) per ``generate`` call (None: all at once).
        media_processor: for a vision-language model, ``(token_ids, media, where) ->
            (expanded_ids, model_kwargs)`` (:class:`~.hf_vision.PlaceholderExpander` is
            built for the Qwen2-VL family); None: prompts with media are refused.
    """

    generate_on_every_rank = True

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        max_batch_size: int | None = None,
        media_processor: MediaProcessor | None = None,
    ) -> None:
        super().__init__(supports_sleep=True)
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        config: Any = model.config
        text: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size: int = int(text.vocab_size)
        self.max_model_len: int | None = max_model_len or getattr(
            text, "max_position_embeddings", None
        )
        self.max_batch_size = max_batch_size
        self.media_processor = media_processor
        self.pad_token_id = int(getattr(text, "pad_token_id", None) or 0)
        self._params = dict(self.model.named_parameters())
        self._staged: dict[str, torch.Tensor] = {}

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> HFEngine:
        """Load ``spec.model_path`` with ``AutoModelForCausalLM`` in ``spec.dtype``."""
        if spec.tp_size != 1:
            raise ValueError(
                f"the hf engine does not shard: engine_tp_size={spec.tp_size} must be 1 "
                "(each rank serves a full copy); use engine_type='vllm' for tensor parallelism"
            )
        transformers = _transformers()
        path = spec.require_model_path()
        dtype = _TORCH_DTYPES.get(spec.dtype, torch.float32)
        options = dict(spec.native)
        media_processor = options.pop("media_processor", None)
        config = transformers.AutoConfig.from_pretrained(path)
        with outside_zero3():
            if getattr(config, "vision_config", None) is not None:  # a vision-language model
                model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
                if media_processor is None and getattr(config, "image_token_id", None) is not None:
                    from lightrft.engines.hf_vision import PlaceholderExpander

                    media_processor = PlaceholderExpander.from_pretrained(path, config)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return cls(
            model,
            device=spec.device,
            max_model_len=spec.max_model_len,
            max_batch_size=options.pop("max_batch_size", None),
            media_processor=media_processor,
        )

    # -- generation --------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling: Any = None) -> list[GenerationOutput]:
        self._check_open()
        params = as_sampling_params(sampling)
        self.state.check_generate()
        options = generate_options(params.native)  # refuses what it cannot honour
        media = [prompt_media(prompt) for prompt in prompts]
        if any(media) and self.media_processor is None:  # never dropped silently
            index = next(i for i, m in enumerate(media) if m)
            raise EngineError(
                f"prompt {index} carries {', '.join(sorted(media[index]))} items, but this "
                "hf engine serves a text-only model (no media_processor); load a "
                "vision-language model, or use engine_type='vllm' or 'sglang'"
            )
        ids = check_prompts(
            prompts, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        text = [i for i, m in enumerate(media) if not m]
        rows = [ids[i] for i in text for _ in range(params.n)]
        step = self.max_batch_size or len(rows) or 1
        by_prompt: dict[int, list[GenerationOutput]] = {}
        done: list[GenerationOutput] = []
        for start in range(0, len(rows), step):
            done.extend(self._generate_rows(rows[start : start + step], params, options=options))
        for k, i in enumerate(text):
            by_prompt[i] = done[k * params.n : (k + 1) * params.n]
        for i, items in enumerate(media):
            if items:
                by_prompt[i] = self._generate_media(ids[i], items, params, f"prompt {i}", options)
        return [out for i in range(len(prompts)) for out in by_prompt[i]]

    def _generate_media(
        self,
        ids: list[int],
        media: dict[str, list[Any]],
        params: Any,
        where: str,
        options: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        """One prompt with media: its ``n`` samples in one batch (the media repeated)."""
        assert self.media_processor is not None
        expanded, extra = self.media_processor(ids, media, where)
        if self.max_model_len is not None and len(expanded) + params.max_new_tokens > (
            self.max_model_len
        ):
            raise PromptError(
                f"{where}: {len(expanded)} prompt tokens with its media + max_new_tokens="
                f"{params.max_new_tokens} exceed the engine's max_model_len={self.max_model_len}"
            )
        dtype = next(self.model.parameters()).dtype
        batch = {
            key: torch.cat([value] * params.n).to(
                self.device, dtype if value.is_floating_point() else value.dtype
            )
            for key, value in extra.items()
        }
        outputs = self._generate_rows([expanded] * params.n, params, batch, options)
        for out in outputs:
            out.prompt_token_ids = list(ids)  # as given, one placeholder per item
        return outputs

    def _generate_rows(
        self,
        rows: list[list[int]],
        params: Any,
        extra: dict[str, torch.Tensor] | None = None,
        options: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        transformers = _transformers()
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        greedy = params.temperature == 0
        stops = list(params.stop_token_ids)
        config = transformers.GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            # 0 turns transformers' top-k off (None would fall back to its default, 50)
            top_k=None if greedy else max(params.top_k, 0),
            eos_token_id=stops or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=params.logprobs,
            **(options or {}),
        )
        with torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                **(extra or {}),
            )
        new = out.sequences[:, width:].cpu()
        logprobs = None
        if params.logprobs:
            # scores are the logits after the warpers (temperature, top-k, top-p: masked
            # tokens at -inf), the distribution each token was drawn from
            steps = torch.stack([step.float() for step in out.scores], dim=1).log_softmax(-1)
            logprobs = steps.gather(-1, new[:, : steps.shape[1]].to(steps.device).unsqueeze(-1))
            logprobs = logprobs.squeeze(-1).cpu()
        results = []
        for i, row in enumerate(rows):
            tokens = new[i].tolist()
            finish, end = "length", len(tokens)
            for j, token in enumerate(tokens):
                if token in stops:
                    finish, end = "stop", j + 1
                    break
            results.append(
                GenerationOutput(
                    prompt_token_ids=list(row),
                    output_token_ids=tokens[:end],
                    finish_reason=finish,
                    logprobs=None if logprobs is None else logprobs[i, :end].tolist(),
                    weight_version=self.weight_version,
                )
            )
        return results

    def _rng_devices(self) -> list[torch.device]:
        return [self.device] if self.device.type == "cuda" else []

    # -- weights -----------------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter a sync must send (tied weights once)."""
        return {name: tuple(p.shape) for name, p in self._params.items()}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_open()
        self.state.check_update()
        batch = list(named_tensors)
        try:
            check_weight_shapes(
                self.weight_shapes(), {n: tuple(t.shape) for n, t in batch}, complete=False
            )
        except EngineError:
            self._staged.clear()  # the whole sync is refused
            raise
        for name, tensor in batch:
            param = self._params[name]
            self._staged[name] = tensor.detach().to(param.device, param.dtype, copy=True)

    def finish_weight_update(self) -> None:
        self._finish(complete=True)

    def finish_partial_weight_update(self) -> None:
        self._finish(complete=False)

    def _finish(self, complete: bool) -> None:
        self._check_open()
        staged, self._staged = self._staged, {}
        check_weight_shapes(
            self.weight_shapes(), {n: tuple(t.shape) for n, t in staged.items()}, complete=complete
        )
        with torch.no_grad():
            for name, tensor in staged.items():
                self._params[name].copy_(tensor)
        self._synced(complete)

    # -- sleep -------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def _resume(self, tags: Sequence[str] | None, asleep: Sequence[str], level: int | None) -> None:
        if self.state.weights_awake and self.device.type != "cpu":
            self.model.to(self.device)

    def _close(self) -> None:
        self._staged.clear()


#: vLLM/SGLang sampling options that ``generate`` takes under its own name.
_TO_GENERATE = {
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "min_new_tokens": "min_new_tokens",
}
#: Options that leave the sampled token ids unchanged at these values.
_NO_EFFECT_AT = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
#: Options about text, not tokens (the engine returns token ids), and ``ignore_eos``
#: (this engine stops only at ``stop_token_ids``, never at EOS on its own).
_TEXT_ONLY = frozenset({
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "detokenize", "no_stop_trim", "ignore_eos",
})  # fmt: skip


def generate_options(native: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's or SGLang's sampling options (``SamplingParams.native``) as
    ``GenerationConfig`` fields: repetition penalty and minimum length are honoured,
    text-only options and penalties at their no-op value are accepted, anything else
    raises :class:`EngineError` naming it (the engine would otherwise sample from
    another distribution than the one asked for)."""
    options: dict[str, Any] = {}
    refused = []
    for key, value in native.items():
        if key in _TO_GENERATE:
            if value is not None:
                options[_TO_GENERATE[key]] = value
        elif key in _TEXT_ONLY or (key in _NO_EFFECT_AT and value in (None, _NO_EFFECT_AT[key])):
            continue
        else:
            refused.append(f"{key}={value!r}")
    if refused:
        raise EngineError(
            f"the hf engine cannot honour sampling option(s) {', '.join(sorted(refused))}; it "
            f"takes repetition_penalty, min_tokens/min_new_tokens, text-only options and "
            f"{', '.join(f'{k}={v}' for k, v in _NO_EFFECT_AT.items())}. Drop them, or use "
            "engine_type='vllm' or 'sglang'"
        )
    return options


@contextlib.contextmanager
def outside_zero3() -> Iterator[None]:
    """transformers' ``from_pretrained`` with any ZeRO-3 config switched off: our
    DeepSpeed strategy at ZeRO-3 keeps an ``HfDeepSpeedConfig`` alive while it lives
    (upstream's holds one only inside ``init_model_context``), and under it
    ``from_pretrained`` would load the engine's model as empty ZeRO-3 partitions; the
    engine serves a full copy."""
    try:
        hf_ds = importlib.import_module("transformers.integrations.deepspeed")
    except ImportError:
        yield
        return
    ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds.set_hf_deepspeed_config(config)
