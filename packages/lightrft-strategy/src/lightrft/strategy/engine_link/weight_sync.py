"""Weight sync from the training model to the rollout engine: full tensors gathered
one at a time from sharded parameters (a backend hook) and sent in buckets, or pulled
by an engine that streams (:class:`~lightrft.engines.WeightStreaming`); names and
shapes checked first; the engine's output checked against the trainer's on request."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightrft.strategy import lora, roll_call
from lightrft.strategy.actor import training_module, unwrap_model
from lightrft.strategy.engine_link.adapter_sync import AdapterSender
from lightrft.strategy.engine_link.common import (
    EngineSlot,
    capabilities_module,
    limits,
    logger,
    protocol_module,
    weight_version,
)
from lightrft.strategy.engine_link.generation import Generation
from lightrft.strategy.engine_link.sleep import Sleep
from lightrft.strategy.tensors import full_shape

if TYPE_CHECKING:
    from lightrft.strategy.backend import Backend
    from lightrft.strategy.world import World

#: Default size of one weight-sync bucket.
DEFAULT_BUCKET_BYTES = 256 * 2**20


class SyncTensors:
    """The tensors of one weight sync, each gathered as it is pulled (a gather may be a
    collective the other ranks take part in): counts the seconds spent pulling,
    remembers whether a gather raised, and drains what is left."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._tensors = tensors
        self.pulled_s = 0.0
        self.gather_failed = False

    def __iter__(self) -> SyncTensors:
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


class WeightSync:
    """:meth:`update_engine_weights` and :meth:`verify_engine_weights`, and what the
    engine holds after each sync."""

    def __init__(
        self,
        world: World,
        backend: Backend,
        slot: EngineSlot,
        sleep: Sleep,
        generation: Generation,
        adapters: AdapterSender,
    ) -> None:
        self.world = world
        self.backend = backend
        self.slot = slot
        self.sleep = sleep
        self.generation = generation
        self.adapters = adapters
        #: LoRA models whose merged weights reached this engine in full once: later
        #: syncs send only what the adapter can change.
        self._synced_in_full: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._last: weakref.ref[nn.Module] | None = None  # the model last synced
        self._last_changes = -1  # its weight changes then
        #: Per model: what the engine got at the last sync (the model's weight_changes,
        #: the engine's weight_version after it, the sync's renaming and dtype).
        self._engine_holds: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = (
            weakref.WeakKeyDictionary()
        )

    def forget(self) -> None:
        """A new engine is attached: it holds nothing synced by the link."""
        self._synced_in_full = weakref.WeakSet()
        self._engine_holds = weakref.WeakKeyDictionary()
        self._last = None
        self._last_changes = -1

    def last_model(self) -> nn.Module | None:
        """The model the last sync sent (while it lives)."""
        return None if self._last is None else self._last()

    def trainer_ahead(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights changed since the last sync sent them."""
        return self.weight_changes(training_module(model)) != self._last_changes

    def weight_changes(self, model: nn.Module) -> int:
        """How often the strategy has changed ``model``'s weights (its StepState)."""
        return self.world.step_state(model).weight_changes

    def update_engine_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        name_map: Callable[[str], str | None] | None = None,
        dtype: torch.dtype | None = None,
        verify: bool | None = None,
        skip_unchanged: bool = False,
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

        A peft LoRA model sends merged weights (``W + scaling * B @ A``) under the base
        model's names, as :class:`lightrft.strategy.lora.MergedWeights` makes them, so
        any engine serving the base model takes them; after the first such sync to an
        engine that takes partial syncs (``PartialWeightSync``: the Hugging Face engine,
        the fake), only the LoRA layers' weights (and other trainable tensors) are sent,
        unless a level-2 sleep discarded the engine's weights since (then all go again).
        With ``lora_sync="adapter"`` (config) the adapter alone goes to an engine that
        serves adapters (:mod:`.adapter_sync`); to another engine that is an error
        naming it and ``lora_sync="merged"``. ``lora`` in the result says which
        (``"merged"``, ``"merged_delta"``, ``"adapter"``).

        The engine already holds ``model``'s weights when nothing changed them since the
        last sync of ``model`` to it (no optimizer step applied, no ``load_model``,
        ``load_ckpt`` or EMA update: the model's ``StepState.weight_changes``), with the
        same ``name_map`` and ``dtype``, the engine counting no other sync since
        (``weight_version``) and its weights not discarded by a level-2 sleep. Then the
        sync logs so and, with ``skip_unchanged``, sends nothing (``skipped`` in the
        result; a sleeping engine is still woken). Weights edited in place behind the
        strategy's back are not seen: sync those without ``skip_unchanged``.

        Returns ``tensors``, ``buckets`` (the engine calls that carried tensors: 1 for a
        stream), ``bytes``, ``gather_s`` (gathering full tensors), ``load_s`` (inside
        the engine's ``update_weights`` and ``finish_weight_update``, or its stream call
        less the pulls' gathering) and ``weight_version`` (the engine's, when it has
        one); with ``verify``, also ``max_logprob_gap``. Without an engine it logs a
        warning and returns ``{}``, as upstream's base class does."""
        self.world.require_setup("update_engine_weights")
        with roll_call.guard("update_engine_weights"):
            stats = self._update_engine_weights(
                model, bucket_bytes=bucket_bytes, name_map=name_map, dtype=dtype, verify=verify,
                skip_unchanged=skip_unchanged,
            )  # fmt: skip
        if stats:  # (what a later collect_generation sends again when it changed)
            self._last = weakref.ref(model)
            self._last_changes = self.weight_changes(training_module(model))
        return stats

    def _holds(
        self, engine: Any, model: nn.Module, module: nn.Module, how: tuple[Any, ...]
    ) -> bool:
        """Whether ``engine`` holds ``module``'s current weights as synced with ``how``."""
        now = (self.weight_changes(model), weight_version(engine), *how)
        return not self._weights_discarded(engine) and self._engine_holds.get(module) == now

    def _weights_discarded(self, engine: Any) -> bool:
        """Whether ``engine`` lost its weights (a level-2 sleep) and a full sync has not
        brought them back: its ``state`` says so (stale weights), or, for an engine
        keeping none, its weights sleep at level 2."""
        if isinstance(engine, capabilities_module().KeepsSleepState):
            return bool(engine.state.weights_stale)
        return self.world.config.sleep_level == 2 and bool(self.sleep.sleeping(["weights"]))

    def _remember(
        self, engine: Any, model: nn.Module, module: nn.Module, how: tuple[Any, ...]
    ) -> None:
        """Record that ``engine`` now holds ``module``'s current weights, synced with ``how``."""
        self._engine_holds[module] = (self.weight_changes(model), weight_version(engine), *how)

    def _held(
        self,
        engine: Any,
        model: nn.Module,
        module: nn.Module,
        how: tuple[Any, ...],
        *,
        verify: bool | None,
        skip: bool,
    ) -> dict[str, Any] | None:
        """When the engine holds ``module``'s weights: log so, and with ``skip`` wake it
        and return the stats of a sync that sent nothing. None: sync."""
        if not self._holds(engine, model, module, how):
            return None
        changes = self.weight_changes(model)
        if not skip:
            logger.info("update_engine_weights: the engine holds these weights already (%d "
                        "weight changes); sending them again (skip_unchanged=True skips such "
                        "a sync)", changes)  # fmt: skip
            return None
        logger.info("update_engine_weights: the engine holds these weights already (%d "
                    "weight changes); nothing sent", changes)  # fmt: skip
        self.sleep.wake(None, blind=False)
        held = {"tensors": 0, "buckets": 0, "bytes": 0, "gather_s": 0.0, "load_s": 0.0,
                "weight_version": weight_version(engine), "skipped": True}  # fmt: skip
        if self.world.config.verify_engine_sync if verify is None else verify:
            held.update(self.verify_engine_weights(model))
        return held

    def _update_engine_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int,
        name_map: Callable[[str], str | None] | None,
        dtype: torch.dtype | None,
        verify: bool | None,
        skip_unchanged: bool = False,
    ) -> dict[str, Any]:
        engine = self.slot.engine
        if engine is None:  # as upstream's: a trainer without rollouts carries on
            logger.warning(
                "update_engine_weights: no inference engine is set up, nothing was sent "
                "(call strategy.setup_inference_engine(...) first to sync one)"
            )
            return {}
        model = training_module(model)  # upstream's actor: its Hugging Face model's names
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        module = unwrap_model(model)
        offered = capabilities_module()
        how = (name_map, dtype)  # (attaching another engine forgets what the last held)
        held = self._held(engine, model, module, how, verify=verify, skip=skip_unchanged)
        if held is not None:
            return held
        if self.world.config.lora_sync == "adapter" and lora.is_lora_model(module):
            adapter_stats = self.adapters.send(
                engine, model, module, name_map=name_map, dtype=dtype
            )
            self._remember(engine, model, module, how)
            if self.world.config.verify_engine_sync if verify is None else verify:
                adapter_stats.update(self.verify_engine_weights(model))
            return adapter_stats
        # a LoRA model: the engine serves the base model, so it gets the merged weights
        # under the base names; after a full sync, only what the adapter can change (to an
        # engine that takes a partial sync and kept the rest)
        partial = (
            module in self._synced_in_full
            and isinstance(engine, offered.PartialWeightSync)
            and not self._weights_discarded(engine)
        )
        merge = (
            lora.MergedWeights(module, only_touched=partial) if lora.is_lora_model(module) else None
        )
        names = (
            merge.shapes().items()
            if merge is not None
            else ((n, full_shape(p)) for n, p in module.named_parameters())
        )
        sent = self._engine_shapes(names, name_map)
        # None: the engine cannot tell
        expected = engine.weight_shapes() if isinstance(engine, offered.WeightShapes) else None
        if expected is not None:
            protocol_module().check_weight_shapes(
                expected, sent, complete=merge is None or not merge.only_touched
            )
        # a sleeping engine is woken, as upstream's update_engine_weights wakes it before
        # broadcasting (whole, with one wake_up()); here in the order a level-2 sleep
        # needs: the weights, the sync, then the KV cache
        self.sleep.wake(["weights"], blind=False)
        counts = {"tensors": 0, "bytes": 0}

        def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            stream = self.backend.iter_full_parameters(model)
            for name, tensor in merge(stream) if merge is not None else stream:
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
            load_s = self._stream_weights(engine, stream, SyncTensors(full_tensors()))
            buckets = 1 if counts["tensors"] else 0
        else:
            finish = engine.finish_partial_weight_update if partial else engine.finish_weight_update
            buckets, load_s = self._send_buckets(
                engine, SyncTensors(full_tensors()), bucket_bytes, finish
            )
        self.sleep.wake(["kv_cache"], blind=False)
        stats: dict[str, Any] = {
            "tensors": counts["tensors"],
            "buckets": buckets,
            "bytes": counts["bytes"],
            "gather_s": time.perf_counter() - started - load_s,
            "load_s": load_s,
            "weight_version": weight_version(engine),
        }
        if merge is not None:
            stats["lora"] = "merged_delta" if merge.only_touched else "merged"
            self._synced_in_full.add(module)
        self._remember(engine, model, module, how)
        if self.world.config.verify_engine_sync if verify is None else verify:
            stats.update(self.verify_engine_weights(model))
        return stats

    @staticmethod
    def _engine_shapes(
        names: Iterable[tuple[str, tuple[int, ...]]], name_map: Callable[[str], str | None] | None
    ) -> dict[str, tuple[int, ...]]:
        """The engine's name -> shape of what a sync sends, each engine name from one
        training name."""
        sent: dict[str, tuple[int, ...]] = {}
        source: dict[str, str] = {}
        for name, shape in names:
            target = name_map(name) if name_map is not None else name
            if target is None:
                continue
            if target in source:
                raise ValueError(
                    f"name_map maps both {source[target]!r} and {name!r} to {target!r}: each "
                    "engine name must come from one parameter (map one of them to None to "
                    "drop it)"
                )
            source[target], sent[target] = name, shape
        return sent

    @staticmethod
    def _send_buckets(
        engine: Any, tensors: SyncTensors, bucket_bytes: int, finish: Callable[[], None]
    ) -> tuple[int, float]:
        """``engine.update_weights`` per bucket of at most ``bucket_bytes`` (a larger
        tensor alone), then ``finish`` (``finish_weight_update``, or the partial one):
        (buckets, seconds in the engine)."""
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
        finish()
        return buckets, load_s + time.perf_counter() - t0

    @staticmethod
    def _stream_weights(engine: Any, stream: Callable[..., None], tensors: SyncTensors) -> float:
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
            protocol = protocol_module()
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
        protocol = protocol_module()
        engine = self.slot.require("verify_engine_weights")
        model = training_module(model)  # upstream's actor: its Hugging Face model
        vocab = int(limits(engine)[0] or 2)
        ids = list(probe) if probe is not None else [(7 * i + 3) % vocab for i in range(8)]
        params = protocol.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, logprobs=True
        )
        out = self.generation.generate([ids], params)[0]
        if out.logprobs is None:
            raise protocol.EngineError(
                f"{type(engine).__name__} returned no logprobs, so its weights cannot be "
                "verified; turn verify_engine_sync off for this engine"
            )
        tokens = torch.tensor([ids + list(out.output_token_ids)], device=self.world.device)
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
            offered = capabilities_module()
            dtype = engine.dtype if isinstance(engine, offered.ComputeDtype) else "float32"
            fp32 = self.world.config.resolved_precision == "fp32" and dtype in (
                "float32",
                torch.float32,
            )
            tolerance = 1e-3 if fp32 else 0.1
        if not gap <= tolerance:  # NaN fails too
            worst = gaps.index(gap)
            raise protocol.EngineError(
                f"the engine's weights are not the trainer's: its logprob of output token "
                f"{worst} of the probe differs by {gap:.3g} > tolerance {tolerance:g} "
                f"(probe {ids}, engine weight_version "
                f"{weight_version(engine) or '?'}). The last update_engine_weights "
                "did not reach the engine, or it computes in another precision (pass "
                "tolerance=)"
            )
        return {"max_logprob_gap": gap, "probe_tokens": len(gaps)}
