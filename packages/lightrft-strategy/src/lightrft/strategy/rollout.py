"""The inference-engine calls of every strategy: setup, weight sync, generation, sleep.

The strategy talks to an engine only through the protocol of
:mod:`lightrft.engines.protocol` (extra ``engines``). It owns what needs the training
side: gathering full weights from sharded parameters (a backend hook, one tensor at a
time) and streaming them to the engine in buckets, and splitting generation across the
engine's tensor-parallel groups (``engine_tp_size`` consecutive ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.engines.protocol import GenerationOutput, Prompt, SamplingParams

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


class InferenceEngineCalls:
    """Mixed into :class:`~lightrft.strategy.StrategyBase`."""

    inference_engine: Any = None
    _engine_group: Any = None
    _engine_group_ranks: tuple[int, ...] = (0,)

    if TYPE_CHECKING:  # provided by StrategyBase
        config: StrategyConfig

        def get_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        def unwrap_model(self, model: nn.Module) -> nn.Module: ...

        def _require_setup(self, what: str) -> None: ...

    def iter_full_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Backend hook: ``(name, full tensor)`` per parameter, in the same order on
        every rank (collective for sharded parameters). The tensor is valid until the
        next item is requested."""
        for name, param in self.unwrap_model(model).named_parameters():
            yield name, param.detach()

    def setup_inference_engine(self, engine: Any) -> Any:
        """Use ``engine`` (an object implementing
        :class:`lightrft.engines.protocol.InferenceEngine`, one per rank) for rollouts,
        and build the tensor-parallel groups of ``engine_tp_size`` consecutive ranks.
        Collective. Returns the engine."""
        self._require_setup("setup_inference_engine")
        _protocol()
        missing = [name for name in _REQUIRED if not callable(getattr(engine, name, None))]
        if missing:
            raise TypeError(
                f"{type(engine).__name__} is not an inference engine: it lacks "
                f"{', '.join(missing)} (see lightrft.engines.protocol.InferenceEngine)"
            )
        tp = self.config.engine_tp_size
        if self.world_size % tp:
            raise ValueError(
                f"engine_tp_size={tp} does not divide the world size {self.world_size}"
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
        return engine

    def _require_engine(self, what: str) -> Any:
        self._require_setup(what)
        if self.inference_engine is None:
            raise RuntimeError(f"{what} needs strategy.setup_inference_engine(engine) first")
        return self.inference_engine

    def update_engine_weights(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        name_map: Callable[[str], str | None] | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, int]:
        """Send ``model``'s full weights to the engine, gathered one tensor at a time and
        streamed in buckets of at most ``bucket_bytes`` (a tensor larger than that goes
        alone). ``name_map`` renames a training name to the engine's (None drops it);
        ``dtype`` casts floating-point tensors. Collective. Returns counts."""
        engine = self._require_engine("update_engine_weights")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = tensors = buckets = 0
        for name, tensor in self.iter_full_parameters(model):
            target = name_map(name) if name_map is not None else name
            if target is None:
                continue
            value = tensor.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            value = value.clone() if value.data_ptr() == tensor.data_ptr() else value
            nbytes = value.numel() * value.element_size()
            if bucket and size + nbytes > bucket_bytes:
                engine.update_weights(bucket)
                buckets += 1
                bucket, size = [], 0
            bucket.append((target, value))
            size += nbytes
            tensors += 1
        if bucket:
            engine.update_weights(bucket)
            buckets += 1
        engine.finish_weight_update()
        return {"tensors": tensors, "buckets": buckets}

    def gather_and_generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        """Generate for this rank's ``prompts``: the prompts of the engine's
        tensor-parallel group are gathered, generated once, and each rank gets back
        exactly its own outputs (``n`` per prompt, in order). Ranks may hold different
        numbers of prompts (zero too). Collective within the group."""
        engine = self._require_engine("gather_and_generate")
        group_ranks = self._engine_group_ranks
        if len(group_ranks) == 1:
            return list(engine.generate(list(prompts), sampling))
        per_rank: list[Any] = [None] * len(group_ranks)
        dist.all_gather_object(per_rank, list(prompts), group=self._engine_group)
        everything = [prompt for chunk in per_rank for prompt in chunk]
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
        is set; returns whether it slept."""
        level = self.config.sleep_level
        engine = self.inference_engine
        if level is None or engine is None:
            return False
        if not engine.supports_sleep:
            logger.warning("enable_engine_sleep is set but the engine cannot sleep")
            return False
        engine.sleep(level)
        return True

    def wakeup_inference_engine(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: both) when
        ``enable_engine_sleep`` is set."""
        engine = self.inference_engine
        if self.config.sleep_level is None or engine is None:
            return
        if engine.supports_sleep:
            engine.wake_up(tags)
