# size: the engine calls (weight sync, generation, sleep/wake) of one mixin; to be split into an
#   engine-link component, one module each, by issue 24
"""The inference-engine calls of every strategy: setup, weight sync, generation, sleep.

The strategy talks to an engine only through the protocol of
:mod:`lightrft.engines.protocol` (extra ``engines``). It owns what needs the training
side: gathering full weights from sharded parameters (a backend hook, one tensor at a
time) and streaming them to the engine in buckets, and splitting generation across the
engine's tensor-parallel groups (``engine_tp_size`` consecutive ranks).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.strategy.actor import training_module

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.engines.protocol import GenerationOutput

logger = logging.getLogger(__name__)

#: Default size of one weight-sync bucket.
DEFAULT_BUCKET_BYTES = 256 * 2**20
_REQUIRED = ("generate", "sleep", "wake_up", "update_weights", "finish_weight_update", "shutdown")


def _protocol() -> Any:
    try:
        from lightrft.engines import protocol
    except ImportError as exc:
        raise ImportError(
            "inference-engine calls need lightrft-engines; install it with: "
            "pip install 'lightrft-strategy[engines]'"
        ) from exc
    return protocol


def _capabilities() -> Any:
    """:mod:`lightrft.engines.capabilities`: what an engine offers is asked only through
    its protocols' ``isinstance`` checks."""
    _protocol()  # the error naming the extra
    from lightrft.engines import capabilities

    return capabilities


class _SyncTensors:
    """The tensors of one weight sync, each gathered as it is pulled (a gather may be a
    collective the other ranks take part in): counts the seconds spent pulling,
    remembers whether a gather raised, and drains what is left."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._tensors = tensors
        self.pulled_s = 0.0
        self.gather_failed = False

    def __iter__(self) -> _SyncTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return next(self._tensors)
        except StopIteration:
            raise
        except BaseException:
            self.gather_failed = True
            raise
        finally:
            self.pulled_s += time.perf_counter() - t0

    def drain(self) -> int:
        """Gather and drop what is left, so this rank still takes part in every gather
        (none after a gather failed: it is not retried); how many there were."""
        return 0 if self.gather_failed else sum(1 for _ in self)

    @contextlib.contextmanager
    def drained_on_error(self) -> Iterator[None]:
        """Around an engine call within the sync: if the engine raises (an error of its
        own, perhaps on this rank alone), the rest is drained before the error
        propagates, so the other ranks' gathers are not left waiting."""
        try:
            yield
        except Exception:
            with contextlib.suppress(Exception):
                self.drain()
            raise


class InferenceEngineCalls:
    """Mixed into :class:`~lightrft.strategy.StrategyBase`."""

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

    def iter_full_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Backend hook: ``(name, full tensor)`` per parameter, in the same order on
        every rank (collective for sharded parameters). Each tensor stays valid while the
        model is not stepped (a gathered copy, or the parameter itself): a weight sync
        sends them without copying again."""
        for name, param in self.unwrap_model(model).named_parameters():
            yield name, param.detach()

    def setup_inference_engine(
        self,
        engine: Any = None,
        engine_type: str | None = None,
        actor: nn.Module | None = None,
        **engine_options: Any,
    ) -> Any:
        """Set up the rollout engine. Collective. Returns the engine.

        Upstream's form, ``setup_inference_engine(args, engine_type="vllm", actor=actor)``:
        build the engine ``args`` (an argparse namespace or config; None: this strategy's
        config) selects with :func:`lightrft.engines.build_engine` (``engine_type`` and
        ``engine_options`` override it; upstream's default ``engine_type="vllm"``
        ignored ``args.engine_type``, here None reads it), send ``actor``'s weights
        when given, and put the engine to sleep when ``enable_engine_sleep`` is set, in
        upstream's order. Our form, ``setup_inference_engine(engine)``: use a ready
        object implementing :class:`lightrft.engines.protocol.InferenceEngine` (one
        per rank), as handed over (synced with ``actor`` if given, not put to sleep).
        Either way the tensor-parallel groups of ``engine_tp_size`` consecutive ranks
        are built."""
        self._require_setup("setup_inference_engine")
        _protocol()
        built = _is_engine_source(engine)
        if built:
            from lightrft.engines import build_engine

            source = self.config if engine is None else engine
            tp = int(getattr(source, "engine_tp_size", None) or self._sizes().engine_tp_size)
            self._check_tp(tp)
            engine = build_engine(source, engine_type=engine_type, **engine_options)
        missing = [name for name in _REQUIRED if not callable(getattr(engine, name, None))]
        if missing:
            raise TypeError(
                f"{type(engine).__name__} is not an inference engine: it lacks "
                f"{', '.join(missing)} (see lightrft.engines.protocol.InferenceEngine)"
            )
        offered = _capabilities()
        tp = self._check_tp(
            int(engine.tp_size)
            if isinstance(engine, offered.TensorParallel) and engine.tp_size
            else self._sizes().engine_tp_size
        )
        rank = self.get_rank()
        self._engine_group_ranks = tuple(rank - rank % tp + i for i in range(tp))
        self._engine_group = None
        if dist.is_initialized() and tp > 1:
            for first in range(0, self.world_size, tp):  # every rank creates every group
                group = dist.new_group(list(range(first, first + tp)))
                if first == self._engine_group_ranks[0]:
                    self._engine_group = group
        self.inference_engine = engine
        self._warned_no_sleep = False
        self._slept_tags = frozenset()
        if actor is not None:
            self.update_engine_weights(actor)
        if built:  # upstream's order; a ready engine is left as it was handed over
            self.maybe_sleep_inference_engine()
        return engine

    def _check_tp(self, tp: int) -> int:
        """The engine tensor-parallel size this process runs with; raises when ``tp``
        does not divide the world (the fake simulates larger sizes in one process)."""
        if tp < 1 or self.world_size % tp:
            raise ValueError(
                f"engine_tp_size={tp} does not divide the world size {self.world_size}; "
                "choose a divisor of the number of ranks"
            )
        return tp

    @property
    def engine_mp_group(self) -> Any:
        """The process group of this rank's engine tensor-parallel group (None for a
        group of one), upstream's name."""
        return self._engine_group

    def _require_engine(self, what: str) -> Any:
        self._require_setup(what)
        if self.inference_engine is None:
            raise RuntimeError(f"{what} needs strategy.setup_inference_engine(...) first")
        return self.inference_engine

    def update_engine_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        name_map: Callable[[str], str | None] | None = None,
        dtype: torch.dtype | None = None,
        verify: bool | None = None,
    ) -> dict[str, Any]:
        """Send ``model``'s full weights to the engine, gathered one tensor at a time and
        streamed in buckets of at most ``bucket_bytes`` (a tensor larger than that goes
        alone); to an engine with ``update_weights_stream`` (vLLM) in one call that pulls
        each tensor as it loads it (``bucket_bytes`` unused). ``name_map`` renames a
        training name to the engine's (None drops it); ``dtype`` casts floating-point
        tensors. Collective. A sleeping engine is woken (weights, then the sync, then its
        KV cache) and left awake, as upstream's.

        When the engine lists its parameters (``weight_shapes()``), names and shapes are
        checked before the first bucket: a missing, extra or wrongly shaped name raises
        :class:`lightrft.engines.WeightMismatchError` listing them all, and the engine
        keeps its weights. ``verify`` (default: the config's ``verify_engine_sync``)
        then checks the engine against the trainer with :meth:`verify_engine_weights`.

        Returns ``tensors``, ``buckets`` (the engine calls that carried tensors: 1 for a
        stream), ``bytes``, ``gather_s`` (gathering full tensors), ``load_s`` (inside
        the engine's ``update_weights`` and ``finish_weight_update``, or its stream call
        less the pulls' gathering) and ``weight_version`` (the engine's, when it has
        one); with ``verify``, also ``max_logprob_gap``. Without an engine it logs a
        warning and returns ``{}``, as upstream's base class does."""
        self._require_setup("update_engine_weights")
        engine = self.inference_engine
        if engine is None:  # as upstream's: a trainer without rollouts carries on
            logger.warning(
                "update_engine_weights: no inference engine is set up, nothing was sent "
                "(call strategy.setup_inference_engine(...) first to sync one)"
            )
            return {}
        model = training_module(model)  # upstream's actor: its Hugging Face model's names
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        sent: dict[str, tuple[int, ...]] = {}
        source: dict[str, str] = {}
        for name, param in self.unwrap_model(model).named_parameters():
            target = name_map(name) if name_map is not None else name
            if target is None:
                continue
            if target in source:
                raise ValueError(
                    f"name_map maps both {source[target]!r} and {name!r} to {target!r}: each "
                    "engine name must come from one parameter (map one of them to None to "
                    "drop it)"
                )
            source[target], sent[target] = name, _full_shape(param)
        offered = _capabilities()
        # None: the engine cannot tell
        expected = engine.weight_shapes() if isinstance(engine, offered.WeightShapes) else None
        if expected is not None:
            _protocol().check_weight_shapes(expected, sent)
        # a sleeping engine is woken, as upstream's update_engine_weights wakes it before
        # broadcasting (whole, with one wake_up()); here in the order a level-2 sleep
        # needs: the weights, the sync, then the KV cache
        self._wake(["weights"], blind=False)
        counts = {"tensors": 0, "bytes": 0}

        def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.iter_full_parameters(model):
                target = name_map(name) if name_map is not None else name
                if target is None:
                    continue
                value = tensor.detach()
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                counts["tensors"] += 1
                counts["bytes"] += value.numel() * value.element_size()
                yield target, value

        started = time.perf_counter()
        if isinstance(engine, offered.WeightStreaming):
            stream = engine.update_weights_stream
            load_s = self._stream_weights(engine, stream, _SyncTensors(full_tensors()))
            buckets = 1 if counts["tensors"] else 0
        else:
            buckets, load_s = self._send_buckets(engine, _SyncTensors(full_tensors()), bucket_bytes)
        self._wake(["kv_cache"], blind=False)
        stats: dict[str, Any] = {
            "tensors": counts["tensors"],
            "buckets": buckets,
            "bytes": counts["bytes"],
            "gather_s": time.perf_counter() - started - load_s,
            "load_s": load_s,
            "weight_version": _weight_version(engine),
        }
        if self.config.verify_engine_sync if verify is None else verify:
            stats.update(self.verify_engine_weights(model))
        return stats

    @staticmethod
    def _send_buckets(engine: Any, tensors: _SyncTensors, bucket_bytes: int) -> tuple[int, float]:
        """``engine.update_weights`` per bucket of at most ``bucket_bytes`` (a larger
        tensor alone), then ``finish_weight_update``: (buckets, seconds in the engine)."""
        load_s = 0.0
        buckets = size = 0
        bucket: list[tuple[str, torch.Tensor]] = []

        def send() -> None:
            nonlocal load_s, buckets, bucket, size
            t0 = time.perf_counter()
            with tensors.drained_on_error():
                engine.update_weights(bucket)
            load_s += time.perf_counter() - t0
            buckets += 1
            bucket, size = [], 0

        for name, value in tensors:
            nbytes = value.numel() * value.element_size()
            if bucket and size + nbytes > bucket_bytes:
                send()
            bucket.append((name, value))
            size += nbytes
        if bucket:
            send()
        t0 = time.perf_counter()
        engine.finish_weight_update()
        return buckets, load_s + time.perf_counter() - t0

    @staticmethod
    def _stream_weights(engine: Any, stream: Callable[..., None], tensors: _SyncTensors) -> float:
        """The whole sync in one ``engine.update_weights_stream`` call that pulls each
        tensor from ``tensors`` (gathered as it is pulled): the seconds in the engine,
        the pulls' gathering excluded. An engine that returns without reading every
        tensor is an error, counted in the message; before it is raised, and before an
        error of the engine's own propagates, the rest are drained (gathering is
        collective: a rank whose engine failed alone still does its part, so the others
        do not hang)."""
        t0 = time.perf_counter()
        with tensors.drained_on_error():
            stream(tensors)
        load_s = time.perf_counter() - t0 - tensors.pulled_s
        unread = tensors.drain()
        if unread:
            protocol = _protocol()
            raise protocol.EngineError(
                f"{type(engine).__name__}.update_weights_stream returned with {unread} "
                "tensor(s) unread: the engine's weights are incomplete; it must read the "
                "iterable to its end or raise"
            )
        return load_s

    def verify_engine_weights(
        self,
        model: nn.Module,
        *,
        probe: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        tolerance: float | None = None,
    ) -> dict[str, Any]:
        """Check that the engine generates from ``model``'s weights: the engine's
        logprobs of a short greedy continuation of ``probe`` must equal the trainer's own
        (a forward pass of ``model``) within ``tolerance`` (default 1e-3 when both
        compute in fp32, else 0.1). Collective (the forward too). Raises
        :class:`lightrft.engines.EngineError` naming the gap, the token and the
        tolerance; returns ``max_logprob_gap`` and ``probe_tokens``."""
        protocol = _protocol()
        engine = self._require_engine("verify_engine_weights")
        model = training_module(model)  # upstream's actor: its Hugging Face model
        limits = _limits(engine)
        vocab = int(limits[0] or 2)
        ids = list(probe) if probe is not None else [(7 * i + 3) % vocab for i in range(8)]
        params = protocol.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, logprobs=True
        )
        out = self.gather_and_generate([ids], params)[0]
        if out.logprobs is None:
            raise protocol.EngineError(
                f"{type(engine).__name__} returned no logprobs, so its weights cannot be "
                "verified; turn verify_engine_sync off for this engine"
            )
        tokens = torch.tensor([ids + list(out.output_token_ids)], device=self.device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                result = model(tokens)
        finally:
            model.train(was_training)
        logits = getattr(result, "logits", result)
        mine = logits[0].float().log_softmax(-1)
        start = len(ids)
        gaps = [
            abs(float(mine[start - 1 + j, token]) - float(theirs))
            for j, (token, theirs) in enumerate(
                zip(out.output_token_ids, out.logprobs, strict=True)
            )
        ]
        gap = max(gaps, default=0.0)
        if tolerance is None:
            offered = _capabilities()
            dtype = engine.dtype if isinstance(engine, offered.ComputeDtype) else "float32"
            fp32 = self.config.resolved_precision == "fp32" and dtype in ("float32", torch.float32)
            tolerance = 1e-3 if fp32 else 0.1
        if not gap <= tolerance:  # NaN fails too
            worst = gaps.index(gap)
            raise protocol.EngineError(
                f"the engine's weights are not the trainer's: its logprob of output token "
                f"{worst} of the probe differs by {gap:.3g} > tolerance {tolerance:g} "
                f"(probe {ids}, engine weight_version "
                f"{_weight_version(engine) or '?'}). The last update_engine_weights "
                "did not reach the engine, or it computes in another precision (pass "
                "tolerance=)"
            )
        return {"max_logprob_gap": gap, "probe_tokens": len(gaps)}

    def gather_and_generate(
        self,
        prompts: Any = None,
        sampling: Any = None,
        *,
        sampling_params: Any = None,
        all_prompt_token_ids: Sequence[Sequence[int]] | None = None,
        all_prompts: Sequence[Any] | None = None,
        all_images: Sequence[Any] | None = None,
        sleep_engine: bool | None = None,
        images_num: Sequence[int] | None = None,
        all_videos: Sequence[Any] | None = None,
        videos_num: Sequence[int] | None = None,
        **more_media: Any,
    ) -> list[GenerationOutput]:
        """Generate for this rank's prompts: the prompts of the engine's tensor-parallel
        group are gathered, checked (an empty prompt, a token id outside the vocabulary
        or a prompt too long for ``max_model_len`` raises on every rank before any
        generates, naming the rank and index), generated once, and each rank gets back
        exactly its own outputs (``n`` per prompt, in order). Ranks may hold different
        numbers of prompts (zero too). Collective within the group.

        Our form: ``gather_and_generate(prompts, sampling)``. Upstream's form:
        ``gather_and_generate(sampling_params, all_prompt_token_ids=...)``, the sampling
        parameters positional or as ``sampling_params=`` (or
        ``all_prompts`` with ``all_images``/``images_num``/``all_videos``/``videos_num``
        for multimodal engines; each prompt gets all of its items, in order; another
        registered modality comes with its own keywords, e.g. ``all_audios`` and
        ``audios_num``, see :mod:`lightrft.engines.multimodal`).

        Both forms wake a sleeping engine first. After generating, upstream's form puts
        it back to sleep unless ``sleep_engine=False``; ours only with
        ``sleep_engine=True`` (either way only when ``enable_engine_sleep`` is set).
        ``sampling`` may be :class:`lightrft.engines.SamplingParams` or the engine's own:
        vLLM's ``SamplingParams`` pass through to vLLM unchanged; a dict (SGLang's, as
        upstream builds it) has its known keys mapped to ours and engine-specific ones
        handed to the engine (:func:`lightrft.engines.protocol.as_sampling_params`; a key
        no engine knows raises ``SamplingError`` naming it).

        Upstream's multimodal prompts are built by :meth:`_build_multimodal_inputs`
        (upstream's hook, called with its keywords; an override, such as upstream's
        audio example's, replaces it)."""
        if sampling_params is not None:
            given = all_prompt_token_ids is not None or all_prompts is not None
            ours = prompts is not None and not given and _looks_like_prompts(prompts)
            if sampling is not None or (prompts is not None and not ours):
                raise TypeError(
                    "gather_and_generate got sampling parameters twice (sampling_params= and "
                    "a positional argument); call gather_and_generate(sampling_params=..., "
                    "all_prompt_token_ids=[...]) or gather_and_generate(prompts, sampling)"
                )
            if prompts is not None:  # our form, sampling by upstream's keyword
                sampling = sampling_params
            else:  # upstream's form: sampling_params fills its first positional slot
                prompts = sampling_params
                if not given:
                    all_prompt_token_ids = []  # no prompts: nothing to generate
        upstream = (
            all_prompt_token_ids is not None
            or all_prompts is not None
            or (prompts is not None and not _looks_like_prompts(prompts))
        )
        if not upstream:
            self._wake(None, blind=False)
            try:
                return self._gather_generate(prompts or [], sampling)
            finally:  # a refused prompt too: the trainer gets the memory back
                if sleep_engine:
                    self.maybe_sleep_inference_engine()
        sampling_params = prompts
        if all_prompt_token_ids is None and all_prompts is None and sampling is not None:
            all_prompt_token_ids = sampling  # upstream's second positional argument
        if all_prompt_token_ids is None and all_prompts is None:
            raise TypeError(
                "gather_and_generate got no prompts: pass gather_and_generate(prompts, "
                "sampling) with a list of token-id lists, or upstream's "
                "gather_and_generate(sampling_params, all_prompt_token_ids=[...])"
            )
        more = _more_media(more_media)
        multimodal = any(x is not None for x in (all_images or ())) or any(
            x is not None for x in (all_videos or ())
        )
        multimodal = multimodal or any(items is not None for items, _ in more.values())
        refused: Exception | None = None  # raised on every rank of the group, below
        if multimodal:
            from lightrft.engines.multimodal import MediaError

            try:
                inputs: list[Any] = self._build_multimodal_inputs(
                    all_prompts=(
                        all_prompts if all_prompts is not None else list(all_prompt_token_ids or [])
                    ),
                    all_images=all_images, images_num=images_num,
                    all_videos=all_videos, videos_num=videos_num, **more,
                )  # fmt: skip
            except MediaError as exc:
                inputs, refused = [], exc
        elif all_prompt_token_ids is not None:
            inputs = list(all_prompt_token_ids)
        else:
            inputs = [{"prompt": text} for text in all_prompts or []]
        if refused is None:
            self.wakeup_inference_engine()
        try:
            return self._gather_generate(inputs, sampling_params, refused=refused)
        finally:
            if sleep_engine is not False:
                self.maybe_sleep_inference_engine()

    def _build_multimodal_inputs(
        self,
        all_prompts: Sequence[Any],
        all_images: Sequence[Any] | None = None,
        images_num: Sequence[int] | None = None,
        all_videos: Sequence[Any] | None = None,
        videos_num: Sequence[int] | None = None,
        **more: tuple[Sequence[Any] | None, Sequence[int] | None],
    ) -> list[dict[str, Any]]:
        """Upstream's hook: the engine inputs of upstream's multimodal form (see
        :func:`build_multimodal_inputs`). Override it (on the class or the instance, as
        upstream's audio example does) to build other inputs."""
        return build_multimodal_inputs(
            all_prompts, all_images, images_num, all_videos, videos_num, **more
        )

    def engine_generate_local(
        self,
        sampling_params: Any,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        multi_modal_inputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate on this rank's engine alone, without gathering (upstream's call):
        exactly one of ``prompt_token_ids`` and ``multi_modal_inputs``."""
        engine = self._require_engine("engine_generate_local")
        if (prompt_token_ids is None) == (multi_modal_inputs is None):
            raise ValueError(
                "engine_generate_local takes exactly one of prompt_token_ids and multi_modal_inputs"
            )
        prompts = list(prompt_token_ids if prompt_token_ids is not None else multi_modal_inputs)  # type: ignore[arg-type]
        self._check_prompts(engine, prompts, sampling_params, [len(prompts)], 0)
        return list(engine.generate(prompts, sampling_params))

    def _check_prompts(
        self, engine: Any, prompts: list[Any], sampling: Any, counts: list[int], first: int
    ) -> None:
        protocol = _protocol()
        params = protocol.as_sampling_params(sampling)
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]

        def describe(index: int) -> str:
            slot = next(i for i in range(len(counts)) if index < bounds[i + 1])
            return f"prompt {index - bounds[slot]} of rank {first + slot}"

        token_prompts = [
            (i, p)
            for i, p in enumerate(prompts)
            if not (isinstance(p, Mapping) and "prompt_token_ids" not in p and "prompt" in p)
        ]
        vocab_size, max_model_len = _limits(engine)
        for index, prompt in token_prompts:
            protocol.check_prompts(
                [prompt], params,
                vocab_size=vocab_size,
                max_model_len=max_model_len,
                describe=lambda _, index=index: describe(index),
            )  # fmt: skip

    def _gather_generate(
        self, prompts: Sequence[Any], sampling: Any, refused: Exception | None = None
    ) -> list[GenerationOutput]:
        """``refused``: this rank's inputs could not be built; every rank of the group
        raises it (named with the rank), none generates."""
        engine = self._require_engine("gather_and_generate")
        group_ranks = self._engine_group_ranks
        if len(group_ranks) == 1:
            if refused is not None:
                raise refused
            self._check_prompts(engine, list(prompts), sampling, [len(prompts)], self.get_rank())
            return list(engine.generate(list(prompts), sampling))
        mine = (list(prompts), None if refused is None else str(refused))
        gathered: list[Any] = [None] * len(group_ranks)
        dist.all_gather_object(gathered, mine, group=self._engine_group)
        errors = [
            (rank, error) for rank, (_, error) in zip(group_ranks, gathered, strict=True) if error
        ]
        if errors:
            from lightrft.engines.multimodal import MediaError

            rank, error = errors[0]
            raise MediaError(f"rank {rank}: {error}")
        per_rank = [chunk for chunk, _ in gathered]
        everything = [prompt for chunk in per_rank for prompt in chunk]
        # every rank checks the same prompts: all raise, none has started generating
        self._check_prompts(
            engine, everything, sampling, [len(c) for c in per_rank], group_ranks[0]
        )
        leader = group_ranks[0]
        if engine.generate_on_every_rank:
            outputs = list(engine.generate(everything, sampling)) if everything else []
        else:
            holder: list[Any] = [None]
            if self.get_rank() == leader:
                holder[0] = list(engine.generate(everything, sampling)) if everything else []
            dist.broadcast_object_list(holder, src=leader, group=self._engine_group)
            outputs = holder[0]
        n = len(outputs) // len(everything) if everything else 1
        index = group_ranks.index(self.get_rank())
        start = sum(len(chunk) for chunk in per_rank[:index]) * n
        return outputs[start : start + len(per_rank[index]) * n]

    def maybe_sleep_inference_engine(self) -> bool:
        """Put the engine to sleep at ``engine_sleep_level`` when ``enable_engine_sleep``
        is set; returns whether it slept. A half-awake engine (a sync or generation was
        interrupted between its wake-ups) is woken whole first, then put to sleep."""
        level = self.config.sleep_level
        engine = self.inference_engine
        if level is None or engine is None:
            return False
        asleep = self._sleeping(None)
        if asleep:
            if set(asleep) == set(_protocol().WAKE_TAGS):
                return False  # already asleep (upstream's gather_and_generate sleeps after)
            self._wake_tags(asleep)
        if not engine.supports_sleep:
            if not self._warned_no_sleep:
                logger.warning(
                    "enable_engine_sleep is set but %s cannot sleep here; the strategy skips "
                    "sleeping (logged once)",
                    type(engine).__name__,
                )
                self._warned_no_sleep = True
            return False
        engine.sleep(level)
        if not self._keeps_state(engine):
            self._slept_tags = frozenset(_protocol().WAKE_TAGS)
        return True

    def wakeup_inference_engine(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: both) when
        ``enable_engine_sleep`` is set: what its ``state`` says sleeps, or, for an engine
        that keeps no :class:`lightrft.engines.SleepState`, what is asked."""
        self._wake(tags, blind=True)

    @staticmethod
    def _keeps_state(engine: Any) -> bool:
        return isinstance(engine, _capabilities().KeepsSleepState)

    def _sleeping(self, tags: Sequence[str] | None) -> list[str]:
        """Which of ``tags`` (None: all) sleep, in wake-up order: what the engine's
        SleepState says, or, for an engine that keeps none, what the strategy put to
        sleep. An unknown tag is kept, for the engine to refuse."""
        engine = self.inference_engine
        known = _protocol().WAKE_TAGS
        if self._keeps_state(engine):
            asleep: list[str] = engine.state.asleep_tags()
        else:
            asleep = [t for t in known if t in self._slept_tags]
        if tags is None:
            return asleep
        return [t for t in tags if t in asleep or t not in known]

    def _wake_tags(self, asleep: Sequence[str]) -> None:
        """Wake ``asleep`` (every tag at once as None: the adapters' full wake-up)."""
        full = set(asleep) == set(_protocol().WAKE_TAGS)
        self.inference_engine.wake_up(None if full else list(asleep))
        self._slept_tags = self._slept_tags - set(asleep)

    def _wake(self, tags: Sequence[str] | None, *, blind: bool) -> None:
        """Wake what sleeps of ``tags`` when sleep is enabled. ``blind``: an engine that
        keeps no SleepState gets the call as asked (the explicit call, for an engine
        put to sleep by someone else); otherwise such an engine is woken of what the
        strategy put to sleep (the engine calls' own wake-ups)."""
        engine = self.inference_engine
        if self.config.sleep_level is None or engine is None or not engine.supports_sleep:
            return
        if blind and not self._keeps_state(engine):
            engine.wake_up(tags)
            self._slept_tags = self._slept_tags - set(tags or _protocol().WAKE_TAGS)
            return
        asleep = self._sleeping(tags)
        if asleep:
            self._wake_tags(asleep)


def _weight_version(engine: Any) -> int | None:
    return engine.weight_version if isinstance(engine, _capabilities().WeightVersion) else None


def _limits(engine: Any) -> tuple[int | None, int | None]:
    """The engine's (vocab_size, max_model_len); None where it does not know."""
    if isinstance(engine, _capabilities().PromptLimits):
        return engine.vocab_size, engine.max_model_len
    return None, None


def _more_media(kwargs: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keywords of registered modalities other than image and video -> {name: (items,
    counts)}; an unknown keyword is a TypeError naming the ones accepted."""
    if not kwargs:
        return {}
    from lightrft.engines.multimodal import MODALITIES

    extra = {m.name: m for m in MODALITIES.values() if m.name not in ("image", "video")}
    accepted = {arg for m in extra.values() for arg in (m.items_arg, m.counts_arg)}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"gather_and_generate got unexpected keyword(s) {unknown}; other modalities' "
            f"keywords: {sorted(accepted) or 'none registered'} "
            "(lightrft.engines.multimodal.register_modality)"
        )
    return {
        name: (kwargs.get(m.items_arg), kwargs.get(m.counts_arg))
        for name, m in extra.items()
        if m.items_arg in kwargs or m.counts_arg in kwargs
    }


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


def _looks_like_prompts(obj: Any) -> bool:
    """A list of prompts (token-id lists or prompt dicts), not sampling parameters."""
    if isinstance(obj, (str, bytes, Mapping)) or not isinstance(obj, Sequence):
        return False
    return all(
        isinstance(p, Mapping) or (isinstance(p, Sequence) and not isinstance(p, str)) for p in obj
    )


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of a parameter (DeepSpeed ZeRO-3 keeps it in ``ds_shape``;
    a DTensor's shape is already the global one)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(shape if shape is not None else param.shape)


def build_multimodal_inputs(
    prompts: Sequence[Any],
    images: Sequence[Any] | None,
    images_num: Sequence[int] | None,
    videos: Sequence[Any] | None,
    videos_num: Sequence[int] | None,
    **more: tuple[Sequence[Any] | None, Sequence[int] | None],
) -> list[dict[str, Any]]:
    """Upstream's multimodal prompts in the canonical form
    (:func:`lightrft.engines.multimodal.build_multimodal_inputs`): one ``{"prompt": text,
    "multi_modal_data": {"image": [...], "video": [...]}}`` per prompt, every item of a
    prompt in order (none: no ``multi_modal_data``). ``images``/``videos`` are one list
    per prompt or one flat list cut by ``images_num``/``videos_num``; ``more`` maps other
    registered modalities to (items, counts). Counts and items that disagree raise
    :class:`lightrft.engines.multimodal.MediaError` naming the prompt. As upstream, a
    text prompt left without images or videos loses its vision placeholders
    (``<|vision_start|><|image_pad|>...<|vision_end|>``)."""
    from lightrft.engines.multimodal import build_multimodal_inputs as canonical

    media = {"image": (images, images_num), "video": (videos, videos_num), **more}
    out = canonical(prompts, {k: v for k, v in media.items() if v[0] is not None or v[1]})
    for entry in out:
        text = entry.get("prompt")
        if isinstance(text, str) and "multi_modal_data" not in entry:
            entry["prompt"] = _VISION_PLACEHOLDERS.sub("", text)
    return out


_VISION_PLACEHOLDERS = re.compile(
    r"<\|vision_start\|>((<\|image_pad\|>)+|(<\|video_pad\|>)+)<\|vision_end\|>"
)
