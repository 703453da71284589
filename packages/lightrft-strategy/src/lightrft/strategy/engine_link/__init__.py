"""The strategy's link to its rollout engine: setup, weight sync, generation, sleep.

The strategy talks to an engine only through the protocol of
:mod:`lightrft.engines.protocol` and the optional capabilities of
:mod:`lightrft.engines.capabilities` (extra ``engines``). It owns what needs the
training side: gathering full weights from sharded parameters and streaming them to
the engine (:mod:`.weight_sync`), splitting generation across the engine's
tensor-parallel groups (:mod:`.generation`), waking and sleeping it around both
(:mod:`.sleep`), and sending a LoRA adapter alone (:mod:`.adapter_sync`). Each part is
an object given only what it uses (the world, the backend, the engine's slot, the parts
it calls); :class:`EngineLink` builds them and sets the engine up. A strategy holds one
as ``strategy.engine_link``; the strategy's engine calls (``update_engine_weights``,
...) call its parts, and upstream's calls of other shapes (``gather_and_generate``,
``setup_inference_engine``) do so from
:mod:`lightrft.strategy.upstream_names`, where upstream's call shapes are converted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from lightrft.strategy import distributed
from lightrft.strategy.engine_link.adapter_sync import AdapterSender
from lightrft.strategy.engine_link.common import (
    EngineSlot,
    capabilities_module,
    is_engine,
    protocol_module,
)
from lightrft.strategy.engine_link.generation import Generation, build_multimodal_inputs
from lightrft.strategy.engine_link.sleep import Sleep
from lightrft.strategy.engine_link.submitted import Submitted
from lightrft.strategy.engine_link.weight_sync import DEFAULT_BUCKET_BYTES, WeightSync

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.strategy.backend import Backend
    from lightrft.strategy.world import World

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EngineLink",
    "EngineSlot",
    "build_multimodal_inputs",
    "is_engine",
]

_REQUIRED = ("generate", "sleep", "wake_up", "update_weights", "finish_weight_update", "shutdown")


class EngineLink:
    """The strategy's link to its rollout engine: setup, weight sync, generation,
    sleep/wake. Built by the strategy (``engine_link_class(world, backend)``) from its
    parts: :attr:`sleep`, :attr:`generation`, :attr:`weight_sync` (with the adapter
    sender), sharing :attr:`slot` (the engine and its tensor-parallel group)."""

    def __init__(self, world: World, backend: Backend) -> None:
        self.world = world
        self.backend = backend
        self.slot = EngineSlot(world)
        #: With engine ranks of their own: the engine they serve (set by the strategy).
        self.remote: Any = None
        self.sleep = Sleep(world, self.slot)
        self.generation = Generation(world, self.slot, self.sleep)
        self.weight_sync = WeightSync(
            world, backend, self.slot, self.sleep, self.generation,
            AdapterSender(backend, self.sleep),
        )  # fmt: skip
        self.submitted = Submitted(world, self.slot, self.generation, self.weight_sync)

    @property
    def config(self) -> StrategyConfig:
        return self.world.config

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def inference_engine(self) -> Any:
        """The rollout engine (None until ``setup_inference_engine``)."""
        return self.slot.engine

    @inference_engine.setter
    def inference_engine(self, engine: Any) -> None:
        self.slot.engine = engine

    # -- setup -----------------------------------------------------------------------------

    def attach(self, engine: Any, actor: nn.Module | None = None, *, built: bool = False) -> Any:
        """Use ``engine`` (an object implementing
        :class:`lightrft.engines.protocol.InferenceEngine`, one per rank): build the
        tensor-parallel groups of its ``tp_size`` (else ``engine_tp_size``) consecutive
        ranks, send ``actor``'s weights when given, and, for an engine the strategy
        ``built``, put it to sleep when ``enable_engine_sleep`` is set (upstream's
        order; a ready engine is left as it was handed over). Collective."""
        self.world.require_setup("setup_inference_engine")
        missing = [name for name in _REQUIRED if not callable(getattr(engine, name, None))]
        if missing:
            raise TypeError(
                f"{type(engine).__name__} is not an inference engine: it lacks "
                f"{', '.join(missing)} (see lightrft.engines.protocol.InferenceEngine)"
            )
        offered = capabilities_module()
        tp = self._check_tp(
            int(engine.tp_size)
            if isinstance(engine, offered.TensorParallel) and engine.tp_size
            else self.world.sizes.engine_tp_size
        )
        rank = self.world.get_rank()
        slot = self.slot
        slot.group_ranks = tuple(rank - rank % tp + i for i in range(tp))
        slot.group = None
        if dist.is_initialized() and tp > 1:
            for first in range(0, self.world_size, tp):  # every rank creates every group
                group = distributed.new_group(list(range(first, first + tp)))
                if first == slot.group_ranks[0]:
                    slot.group = group
        slot.engine = engine
        self.sleep.forget()
        self.weight_sync.forget()
        if actor is not None:
            self.weight_sync.update_engine_weights(actor)
        if built:
            self.sleep.maybe_sleep()
        return engine

    def build(
        self,
        source: Any = None,
        engine_type: str | None = None,
        actor: nn.Module | None = None,
        **engine_options: Any,
    ) -> Any:
        """Build the engine ``source`` selects (a config, namespace, mapping or
        EngineSpec; None: this strategy's config) with :func:`lightrft.engines.build_engine`
        (``engine_type`` and ``engine_options`` override it), then :meth:`attach` it.
        Collective."""
        self.world.require_setup("setup_inference_engine")
        protocol_module()
        from lightrft.engines import build_engine

        source = self.config if source is None else source
        if self.remote is not None:  # engine_placement separate: the engine ranks build it
            self.remote.build(source, engine_type, engine_options)
            return self.attach(self.remote, actor, built=True)
        tp = int(getattr(source, "engine_tp_size", None) or self.world.sizes.engine_tp_size)
        self._check_tp(tp)
        engine = build_engine(source, engine_type=engine_type, **engine_options)
        return self.attach(engine, actor, built=True)

    def _check_tp(self, tp: int) -> int:
        """The engine tensor-parallel size this process runs with; raises when ``tp``
        does not divide the world. A world that is one process alone (the fake) plays
        the whole engine group: 1."""
        if self.world.alone and tp > 1:
            return 1
        if tp < 1 or self.world_size % tp:
            raise ValueError(
                f"engine_tp_size={tp} does not divide the world size {self.world_size}; "
                "choose a divisor of the number of ranks"
            )
        return tp

    @property
    def engine_group(self) -> Any:
        """The process group of this rank's engine tensor-parallel group (None for a
        group of one); upstream's ``strategy.engine_mp_group``."""
        return self.slot.group
