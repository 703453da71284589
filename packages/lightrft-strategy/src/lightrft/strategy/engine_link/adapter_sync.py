"""Weight sync of a LoRA actor's adapter alone (``lora_sync="adapter"``), to an engine
that serves adapters (:class:`~lightrft.engines.AdapterSync`): only the adapter's
tensors are gathered and sent; the engine keeps the base model it serves (the one it
was built from, which must be the trained model's base: ``verify_engine_weights``
proves it) and generates with the adapter."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightrft.strategy import lora
from lightrft.strategy.engine_link.common import (
    capabilities_module,
    protocol_module,
    weight_version,
)
from lightrft.strategy.engine_link.sleep import Sleep

if TYPE_CHECKING:
    from lightrft.strategy.backend import Backend


class AdapterSender:
    """The adapter-only path of ``update_engine_weights``."""

    def __init__(self, backend: Backend, sleep: Sleep) -> None:
        self.backend = backend
        self.sleep = sleep

    def send(
        self,
        engine: Any,
        model: nn.Module,
        module: nn.Module,
        *,
        name_map: Callable[[str], str | None] | None,
        dtype: torch.dtype | None,
    ) -> dict[str, Any]:
        """Gather the adapter of ``module`` (every rank), check it against the engine's
        model, and hand it to ``engine.load_adapter``. Returns the sync's stats, with
        ``lora="adapter"``."""
        offered = capabilities_module()
        name = type(engine).__name__
        if not isinstance(engine, offered.AdapterSync):
            raise lora.LoraError(
                f"lora_sync='adapter': {name} cannot serve LoRA adapters (it has no "
                "load_adapter); set lora_sync='merged' to send base + adapter merged under "
                "the base model's names, which every engine takes"
            )
        state = engine.state if isinstance(engine, offered.KeepsSleepState) else None
        if state is not None and state.weights_stale:
            raise protocol_module().EngineError(
                f"lora_sync='adapter': {name}'s base weights were discarded (a level-2 "
                "sleep or an unfinished sync), and an adapter sync does not send them; "
                "sleep at level 1 with adapter syncs, or set lora_sync='merged'"
            )
        adapter = lora.AdapterWeights(module, name_map)
        expected = engine.weight_shapes() if isinstance(engine, offered.WeightShapes) else None
        if expected is not None:
            adapter.check_fits(expected, name)
        self.sleep.wake(["weights"], blind=False)
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for target, tensor in adapter(self.backend.iter_full_parameters(model, adapter.select)):
            value = tensor.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            tensors[target] = value
        gathered = time.perf_counter()
        engine.load_adapter(tensors, adapter.settings)
        load_s = time.perf_counter() - gathered
        self.sleep.wake(["kv_cache"], blind=False)
        return {
            "tensors": len(tensors),
            "buckets": 1,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "gather_s": gathered - started,
            "load_s": load_s,
            "weight_version": weight_version(engine),
            "lora": "adapter",
        }
