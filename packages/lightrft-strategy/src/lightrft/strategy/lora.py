"""LoRA actors (peft, extra ``lora``): the adapter from the configuration, its start under
ZeRO-3, and the merged weights an engine receives.

* :func:`apply_lora` puts a peft LoRA adapter on a model from ``lora_rank``,
  ``lora_alpha``, ``lora_dropout`` and ``target_modules`` (upstream's names); target
  modules that match nothing raise naming the model's linear modules.
* :func:`lora_init_on_full_tensors` is entered by the DeepSpeed backend's ZeRO-3
  ``init_model_context``: inside ``deepspeed.zero.Init`` a LoRA layer's parameters are
  partitioned as soon as they are built, so peft's own start (``lora_B`` zero) would
  write into empty shards and the adapter would start from ``nn.Linear``'s random
  values; here peft's ``reset_lora_parameters`` runs on the gathered tensors (rank 0's
  values, as ZeRO-3 initialises every parameter).
* :class:`MergedWeights` turns the training model's ``(peft name, full tensor)`` stream
  into what an engine serving the base model loads: ``W + scaling * B @ A`` under the
  base model's Hugging Face names, LoRA tensors dropped; with ``only_touched`` only the
  layers the adapter changes (and other trainable tensors) are sent.
* :class:`AdapterWeights` picks the adapter alone out of that stream, under the names
  of peft's ``adapter_model.safetensors``, for an engine that serves adapters
  (``lora_sync="adapter"``), and checks it against the engine's model.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightrft.strategy.tensors import full_shape

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig

__all__ = [
    "AdapterWeights",
    "LoraError",
    "MergedWeights",
    "adapter_settings",
    "apply_lora",
    "base_name",
    "is_lora_model",
    "lora_init_on_full_tensors",
    "merge_state_dict",
    "peft_adapter_state",
    "write_lora_model",
]

#: What peft's PeftModel puts before the base model's own names.
PEFT_PREFIX = "base_model.model."
_LORA_PART = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")


class LoraError(ValueError):
    """A LoRA setting or adapter that cannot be used; the message names the fix."""


def peft_module() -> Any:
    """:mod:`peft`, or an ImportError naming the extra."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "LoRA needs peft; install it with: pip install 'lightrft-strategy[lora]'"
        ) from exc
    return peft


def apply_lora(
    model: nn.Module,
    config: StrategyConfig | None = None,
    *,
    rank: int | None = None,
    alpha: int | None = None,
    dropout: float | None = None,
    target_modules: list[str] | str | None = None,
) -> nn.Module:
    """``model`` (a Hugging Face model) with a peft LoRA adapter: the settings come from
    ``config`` (``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``target_modules``),
    keywords win. Only the adapter is trainable. ``["all-linear"]`` is peft's
    ``"all-linear"``. Build it inside ``strategy.init_model_context()`` together with the
    model, or after it; either way it starts as the base model (``lora_B`` zero)."""
    peft = peft_module()
    rank = rank if rank is not None else (config.lora_rank if config is not None else 0)
    if rank < 1:
        raise LoraError(f"apply_lora: lora_rank={rank}; a LoRA adapter needs lora_rank >= 1")
    alpha = alpha if alpha is not None else (config.lora_alpha if config is not None else 16)
    dropout = dropout if dropout is not None else (config.lora_dropout if config else 0.0)
    targets: Any = target_modules if target_modules is not None else (
        config.target_modules if config is not None else ["all-linear"]
    )  # fmt: skip
    if isinstance(targets, str):
        targets = [targets]
    if list(targets) == ["all-linear"]:
        targets = "all-linear"
    lora_config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
        task_type=peft.TaskType.CAUSAL_LM,
    )  # fmt: skip
    try:
        return peft.get_peft_model(model, lora_config)  # type: ignore[no-any-return]
    except ValueError as exc:
        if "target" not in str(exc).lower():
            raise
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}
        )  # fmt: skip
        raise LoraError(
            f"target_modules={targets!r} match no module of {type(model).__name__}; its "
            f"linear modules are {linear}. Pass some of those names, or all-linear"
        ) from exc


def is_lora_model(module: nn.Module) -> bool:
    """Whether ``module`` holds peft LoRA layers."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return any(isinstance(m, LoraLayer) for m in module.modules())


def base_name(name: str) -> str | None:
    """The base model's Hugging Face name of a peft model's tensor name (None for the
    adapter's own tensors and peft's untouched copies of ``modules_to_save``)."""
    if _LORA_PART.search(name) or ".original_module." in name:
        return None
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


@contextlib.contextmanager
def lora_init_on_full_tensors() -> Iterator[None]:
    """Inside ``deepspeed.zero.Init``: peft's ``reset_lora_parameters`` runs on the
    gathered LoRA tensors (rank 0's values, then partitioned), so the adapter starts as
    peft makes it. Does nothing when peft is not installed."""
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        yield
        return
    import deepspeed

    original = LoraLayer.reset_lora_parameters

    def reset_on_full_tensors(self: Any, adapter_name: str, init_lora_weights: Any) -> None:
        params = [
            p for name, p in self.named_parameters()
            if name.startswith("lora_") and adapter_name in name.split(".")
        ]  # fmt: skip
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            original(self, adapter_name, init_lora_weights)

    LoraLayer.reset_lora_parameters = reset_on_full_tensors
    try:
        yield
    finally:
        LoraLayer.reset_lora_parameters = original


def merge(
    weight: torch.Tensor,
    factors: list[tuple[torch.Tensor, torch.Tensor, float]],
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """``weight + sum(scaling * B @ A)`` over ``(A, B, scaling)``, computed in fp32 and
    returned in ``weight``'s dtype (``B @ A`` transposed for a fan-in-fan-out layer)."""
    merged = weight.detach().to(torch.float32).clone()
    for a, b, scaling in factors:
        delta = b.detach().to(merged.device, torch.float32) @ a.detach().to(
            merged.device, torch.float32
        )
        merged += scaling * (delta.T if fan_in_fan_out else delta)
    return merged.to(weight.dtype)


@dataclass(frozen=True)
class _Layer:
    """One LoRA layer: where its tensors live in the stream and how they merge."""

    prefix: str  # the layer's peft name, e.g. "base_model.model.model.layers.0.mlp.up_proj"
    adapters: tuple[tuple[str, float], ...]  # (adapter name, scaling), the active ones
    fan_in_fan_out: bool


class MergedWeights:
    """The merged weights of a peft LoRA model, by the base model's names.

    Call it on ``(peft name, full tensor)`` pairs in the model's parameter order (a
    backend's ``iter_full_parameters``); it yields ``(base name, tensor)``, a LoRA
    layer's weight as ``W + sum(scaling * B @ A)`` over the active adapters once its
    adapter tensors have passed. With ``only_touched``, only LoRA layers' weights and
    other trainable tensors are yielded (what can have changed since a full sync)."""

    def __init__(self, module: nn.Module, *, only_touched: bool = False) -> None:
        from peft.tuners.lora import LoraLayer

        self.only_touched = only_touched
        self._layers: dict[str, _Layer] = {}
        for name, sub in module.named_modules():
            if not isinstance(sub, LoraLayer):
                continue
            if not isinstance(getattr(sub, "base_layer", None), nn.Module):
                continue
            active = [a for a in sub.active_adapters if a in sub.lora_A]
            if any(sub.use_dora.get(a, False) for a in active) or any(
                sub.lora_bias.get(a, False) for a in active
            ):
                raise LoraError(
                    f"{name}: DoRA and lora_bias adapters are not merged by the weight sync; "
                    "train a plain LoRA adapter (use_dora=False, lora_bias=False)"
                )
            scalings = tuple((a, float(sub.scaling[a])) for a in active)
            self._layers[name] = _Layer(name, scalings, bool(getattr(sub, "fan_in_fan_out", False)))
        self._trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        self._shapes = {
            base: full_shape(p)
            for n, p in module.named_parameters()
            if (base := base_name(n)) is not None and self._sends(n)
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The base names this sync sends, with their full shapes."""
        return dict(self._shapes)

    def _layer_of(self, name: str) -> _Layer | None:
        """The LoRA layer whose base layer holds the tensor ``name``, if any."""
        prefix, _, _ = name.rpartition(".")
        if not prefix.endswith(".base_layer"):
            return None
        return self._layers.get(prefix[: -len(".base_layer")])

    def _sends(self, name: str) -> bool:
        if not self.only_touched:
            return True
        return name in self._trainable or (
            name.endswith(".base_layer.weight") and self._layer_of(name) is not None
        )

    def __call__(
        self, stream: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        waiting: dict[str, torch.Tensor] = {}  # a layer's base weight until its adapter
        parts: dict[str, dict[str, torch.Tensor]] = {}  # layer -> "A.<adapter>" -> tensor
        for name, tensor in stream:
            match = _LORA_PART.search(name)
            if match is not None:
                layer = name[: match.start()]
                if layer not in self._layers or match.group(1) not in ("A", "B"):
                    continue
                adapter = name[match.end() :].split(".", 1)[0]
                parts.setdefault(layer, {})[f"{match.group(1)}.{adapter}"] = tensor
                ready = self._merge_if_ready(layer, waiting, parts)
                if ready is not None:
                    yield ready
                continue
            base = base_name(name)
            if base is None or not self._sends(name):
                continue
            owner = self._layer_of(name)
            if owner is not None and name.endswith(".base_layer.weight"):
                waiting[owner.prefix] = tensor
                ready = self._merge_if_ready(owner.prefix, waiting, parts)
                if ready is not None:
                    yield ready
                continue
            yield base, tensor
        if waiting:
            raise LoraError(
                f"the LoRA tensors of {sorted(waiting)[:3]} never came in the parameter "
                "stream; the model's LoRA layers and its parameters disagree"
            )

    def _merge_if_ready(
        self, prefix: str, waiting: dict[str, torch.Tensor], parts: dict[str, dict[str, Any]]
    ) -> tuple[str, torch.Tensor] | None:
        layer = self._layers[prefix]
        got = parts.get(prefix, {})
        if prefix not in waiting or any(
            f"{k}.{a}" not in got for a, _ in layer.adapters for k in ("A", "B")
        ):
            return None
        factors = [(got[f"A.{a}"], got[f"B.{a}"], scaling) for a, scaling in layer.adapters]
        del parts[prefix]
        name = base_name(f"{prefix}.base_layer.weight")
        assert name is not None
        return name, merge(waiting.pop(prefix), factors, layer.fan_in_fan_out)


def write_lora_model(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    output_dir: Path,
    tokenizer: Any = None,
    *,
    merge: bool = False,
) -> None:
    """Write a peft LoRA model whose full state is ``state`` (peft's names): the adapter
    in peft's format (``adapter_config.json``, ``adapter_model.safetensors``; loads with
    ``PeftModel.from_pretrained(base, output_dir)``), or with ``merge`` the merged model
    as a plain Hugging Face directory (base names, ``W + scaling * B @ A``). Rank 0."""
    from lightrft.strategy.hf_export import write_hf_checkpoint

    output_dir.mkdir(parents=True, exist_ok=True)
    peft_model: Any = module  # peft's PeftModel
    if merge:
        merged = dict(MergedWeights(module)(iter(state.items())))
        base = peft_model.get_base_model() if hasattr(module, "get_base_model") else module
        write_hf_checkpoint(merged, _BaseNames(base), output_dir, tokenizer)
        return
    peft_model.save_pretrained(str(output_dir), state_dict=state)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(output_dir)


class _BaseNames(nn.Module):
    """The base model as ``write_hf_checkpoint`` reads it (its config, generation config
    and tied names) with the base names of its parameters."""

    _base: nn.Module

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_base", base)
        self.config = getattr(base, "config", None)
        self.generation_config = getattr(base, "generation_config", None)
        self._tied_weights_keys = getattr(base, "_tied_weights_keys", None)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in self._base.named_parameters(*args, **kwargs):
            base = base_name(name)
            if base is not None:
                yield base, param


def adapter_settings(module: nn.Module) -> dict[str, Any] | None:
    """The active adapter's peft config as plain JSON values (what a checkpoint records
    so that ``lightrft ckpt export`` can write or merge the adapter without the model),
    or None for a model without LoRA."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs or not is_lora_model(module):
        return None
    active = getattr(module, "active_adapter", None)
    name = active if isinstance(active, str) and active in configs else next(iter(configs))
    settings: dict[str, Any] = configs[name].to_dict()
    for key, value in list(settings.items()):  # sets and enums -> JSON
        if isinstance(value, set):
            settings[key] = sorted(value)
        elif hasattr(value, "value"):
            settings[key] = value.value
    settings["adapter_name"] = name
    return settings


def _scaling(settings: dict[str, Any]) -> float:
    rank, alpha = int(settings["r"]), float(settings["lora_alpha"])
    return alpha / rank**0.5 if settings.get("use_rslora") else alpha / rank


def merge_state_dict(
    state: dict[str, torch.Tensor], settings: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (peft's names, as a checkpoint holds it) merged:
    ``W + scaling * B @ A`` under the base names, the adapter's tensors dropped;
    ``settings`` is :func:`adapter_settings`' record (rank, alpha, rslora, fan-in-fan-out).
    Used offline, where there is no model to read the layers from."""
    if settings.get("use_dora") or settings.get("lora_bias"):
        raise LoraError("DoRA and lora_bias adapters are not merged; export the adapter instead")
    adapter = settings.get("adapter_name", "default")
    scaling = _scaling(settings)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        base = base_name(name)
        if base is None:
            continue
        prefix = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        a = state.get(f"{prefix}.lora_A.{adapter}.weight") if prefix else None
        b = state.get(f"{prefix}.lora_B.{adapter}.weight") if prefix else None
        if a is None or b is None:
            out[base] = tensor
            continue
        out[base] = merge(tensor, [(a, b, scaling)], bool(settings.get("fan_in_fan_out")))
    return out


def peft_adapter_state(
    state: dict[str, torch.Tensor], settings: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (``adapter_model.safetensors``: the
    adapter's name left out of each key)."""
    adapter = settings.get("adapter_name", "default")
    return {
        name.replace(f".{adapter}.", "."): tensor
        for name, tensor in state.items()
        if _LORA_PART.search(name) and f".{adapter}." in name
    }


class AdapterWeights:
    """The active adapter of a peft LoRA model as an engine that serves adapters loads
    it: its ``lora_A``/``lora_B`` tensors under the names of peft's
    ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``; a
    ``name_map`` renames the module as it renames the base weight), and
    :attr:`settings`, its ``adapter_config.json``.

    Raises :class:`LoraError` for what an adapter alone cannot carry: trainable tensors
    outside it (peft's ``modules_to_save``), DoRA, LoRA on embeddings, or a layer that
    ``name_map`` drops; the fix is ``lora_sync="merged"``."""

    def __init__(
        self, module: nn.Module, name_map: Callable[[str], str | None] | None = None
    ) -> None:
        from peft.tuners.lora import LoraLayer

        settings = adapter_settings(module)
        if settings is None:
            raise LoraError("lora_sync='adapter': the model has no LoRA adapter")
        adapter = settings.pop("adapter_name")
        fix = "; use lora_sync='merged' (base + adapter merged, under the base names)"
        if settings.get("use_dora") or settings.get("lora_bias"):
            raise LoraError(f"lora_sync='adapter' sends plain LoRA adapters, not DoRA{fix}")
        outside = [n for n, p in module.named_parameters()
                   if p.requires_grad and not _LORA_PART.search(n)]  # fmt: skip
        if outside:
            raise LoraError(
                f"lora_sync='adapter' sends the adapter alone, and {len(outside)} trainable "
                f"tensors are outside it ({', '.join(outside[:3])}: modules_to_save?){fix}"
            )
        self.settings: dict[str, Any] = settings
        #: peft parameter name -> name in the adapter file.
        self._names: dict[str, str] = {}
        #: the base weight each adapted layer changes (the engine's name) -> its shape.
        self.layers: dict[str, tuple[int, ...]] = {}
        for prefix, sub in module.named_modules():
            if not isinstance(sub, LoraLayer) or adapter not in sub.lora_A:
                continue
            if adapter in getattr(sub, "lora_embedding_A", {}):
                raise LoraError(f"lora_sync='adapter': {prefix} is a LoRA embedding{fix}")
            weight = base_name(f"{prefix}.base_layer.weight")
            assert weight is not None
            target = name_map(weight) if name_map is not None else weight
            if target is None or not target.endswith(".weight"):
                raise LoraError(
                    f"lora_sync='adapter': name_map maps the adapted weight {weight!r} to "
                    f"{target!r}; an adapter layer needs the engine's name of its weight{fix}"
                )
            self.layers[target] = full_shape(sub.get_base_layer().weight)
            saved = PEFT_PREFIX + target[: -len(".weight")]
            for part in ("A", "B"):
                self._names[f"{prefix}.lora_{part}.{adapter}.weight"] = (
                    f"{saved}.lora_{part}.weight"
                )

    def select(self, name: str) -> bool:
        """Whether the parameter ``name`` belongs to the adapter (what is gathered)."""
        return name in self._names

    def __call__(
        self, stream: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            saved = self._names.get(name)
            if saved is not None:
                yield saved, tensor

    def check_fits(self, engine_shapes: Mapping[str, Sequence[int]], engine: str) -> None:
        """Raise :class:`LoraError` unless every adapted weight is one of the engine's
        (``engine_shapes``: its name -> shape) with the same shape, naming those that
        are not."""
        absent = [n for n in self.layers if n not in engine_shapes]
        wrong = [f"{n} {list(s)} (engine: {list(engine_shapes[n])})"
                 for n, s in self.layers.items()
                 if n in engine_shapes and tuple(engine_shapes[n]) != s]  # fmt: skip
        if absent or wrong:
            said = [f"not in the engine's model: {', '.join(absent[:4])}"] if absent else []
            said += [f"of another shape: {', '.join(wrong[:4])}"] if wrong else []
            raise LoraError(
                f"the adapter does not fit {engine}'s model ({'; '.join(said)}): the "
                "engine serves another model than the one trained, or the names need a "
                "name_map; nothing was sent"
            )
