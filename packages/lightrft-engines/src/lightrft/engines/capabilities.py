"""What an engine may offer beyond :class:`~lightrft.engines.protocol.InferenceEngine`.

Each capability is a small runtime-checkable protocol. An adapter declares the ones it
offers by listing them among its bases (the built-in adapters and ``FakeEngine`` do);
an engine of another package that merely has the members passes the same
``isinstance`` checks, as protocols are structural. The strategy's engine calls ask
only through these checks, never by probing attribute names:

========================  =============================================================
capability                what the strategy does with it
========================  =============================================================
:class:`PromptLimits`     checks prompts against ``vocab_size`` and ``max_model_len``
                          before any rank generates
:class:`WeightShapes`     checks names and shapes before the first bucket of a sync
:class:`WeightStreaming`  hands one lazy iterable to ``update_weights_stream`` instead
                          of buckets (each tensor gathered when the engine pulls it)
:class:`WeightVersion`    reports ``weight_version`` in the sync's stats
:class:`TensorParallel`   groups ``tp_size`` consecutive ranks around the engine
:class:`KeepsSleepState`  wakes only what the engine's :class:`SleepState` says sleeps
:class:`PartialWeightSync` after a full sync of a LoRA model, takes only the layers
                          the adapter changes (``finish_partial_weight_update``)
:class:`AdapterSync`      takes a LoRA model's adapter alone (``lora_sync="adapter"``)
                          and generates with it
:class:`ComputeDtype`     picks the tolerance of ``verify_engine_weights`` (1e-3 only
                          when both sides compute in fp32; an engine without it: fp32)
========================  =============================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from lightrft.engines.protocol import SleepState

__all__ = [
    "AdapterSync",
    "ComputeDtype",
    "KeepsSleepState",
    "PartialWeightSync",
    "PromptLimits",
    "TensorParallel",
    "WeightShapes",
    "WeightStreaming",
    "WeightVersion",
]


@runtime_checkable
class PromptLimits(Protocol):
    """Limits a prompt is checked against; None: the engine does not know."""

    vocab_size: int | None
    max_model_len: int | None


@runtime_checkable
class WeightShapes(Protocol):
    def weight_shapes(self) -> Mapping[str, Sequence[int]] | None:
        """Name -> shape of every parameter a sync must send; None when the engine
        cannot tell this time (no check is made)."""
        ...


@runtime_checkable
class WeightStreaming(Protocol):
    def update_weights_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One whole sync in one call: pull every ``(name, full tensor)`` from the
        iterable as it loads it, to its end or raise; the weights count as synced when
        it returns. The tensors follow ``update_weights``' rules (copy, never modify,
        keep no reference)."""
        ...


@runtime_checkable
class WeightVersion(Protocol):
    @property
    def weight_version(self) -> int:
        """How many syncs have finished."""
        ...


@runtime_checkable
class TensorParallel(Protocol):
    #: The ranks one engine instance spans (consecutive ranks).
    tp_size: int


@runtime_checkable
class ComputeDtype(Protocol):
    #: The dtype the engine computes in (``"float32"``, ``"bfloat16"`` or a torch dtype).
    dtype: str | torch.dtype


@runtime_checkable
class PartialWeightSync(Protocol):
    def finish_partial_weight_update(self) -> None:
        """End a sync that sent some of the weights: those are loaded, the others kept
        (``finish_weight_update`` refuses a sync that misses a weight)."""


@runtime_checkable
class AdapterSync(Protocol):
    def load_adapter(
        self, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """Take a LoRA adapter and generate with it from now on (it replaces the one
        taken before; the base weights are those of the last full sync): ``tensors``
        under the names of peft's ``adapter_model.safetensors``
        (``base_model.model.<module>.lora_A.weight``), ``settings`` its
        ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...).
        Counts as a weight sync; the tensors follow ``update_weights``' rules."""


@runtime_checkable
class KeepsSleepState(Protocol):
    #: What sleeps and whether the weights are stale.
    state: SleepState
