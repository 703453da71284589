"""What an engine is built from: :class:`EngineSpec`, read from a ``StrategyConfig`` or
an upstream argparse namespace (duck-typed: this package does not import the config).

Field by field (upstream's names first):

=====================  =============================================================
EngineSpec             read from
=====================  =============================================================
``engine_type``        ``engine_type`` (``"vllm"``, ``"sglang"``, ``"hf"``, registered;
                       left at its default ``"vllm"`` without vLLM installed: ``"hf"``)
``model_path``         ``pretrain`` (upstream's name for the actor's checkpoint)
``tp_size``            ``engine_tp_size``
``mem_util``           ``engine_mem_util`` (default 0.5)
``max_model_len``      ``engine_max_model_len``, else upstream's
                       ``prompt_max_len + generate_max_len``, else the model's own
``dtype``              ``precision``/``bf16``: bf16 -> bfloat16, fp16 -> float16,
                       fp32 -> float32; an upstream namespace with ``bf16=False``
                       (no ``precision``) means float16 on CUDA, as upstream, and
                       float32 on CPU (CPU kernels are for fp32/bf16)
``sleep_level``        ``engine_sleep_level`` when ``enable_engine_sleep`` (default 1)
``seed``               ``seed``
``device``             ``device`` (``"cuda"``, ``"cpu"``; ``None``/``"auto"``: CUDA
                       when available)
``lora_rank``          ``lora_rank`` when ``lora_sync="adapter"`` (the engine is built
                       to serve adapters of that rank); else None
``lora_target_modules`` ``target_modules`` then (``["all-linear"]``: every linear layer)
``native``             ``engine_options`` (a mapping), then keyword arguments
=====================  =============================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _read(source: Any, name: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, default)
    getter = getattr(source, "get_extra_arg", None)  # StrategyConfig: fields and extras
    if callable(getter):
        return getter(name, default)
    return getattr(source, name, default)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine adapter needs to build itself."""

    engine_type: str
    model_path: str | None = None
    tp_size: int = 1
    mem_util: float = 0.5
    max_model_len: int | None = None
    dtype: str = "bfloat16"
    sleep_level: int | None = None
    seed: int = 42
    device: str = "cpu"
    native: Mapping[str, Any] = field(default_factory=dict)
    #: The LoRA rank adapters are sent at (``lora_sync="adapter"``); None: no adapters.
    lora_rank: int | None = None
    #: The modules those adapters target (peft's ``target_modules``).
    lora_target_modules: tuple[str, ...] = ()
    #: Whether ``engine_type`` was chosen (a keyword, a mapping key, an attribute of a
    #: namespace, a field set on a StrategyConfig) rather than left at the default.
    engine_type_chosen: bool = True

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_config(
        cls, source: Any = None, *, engine_type: str | None = None, **native: Any
    ) -> EngineSpec:
        """Read a ``StrategyConfig``, an argparse namespace, a mapping or None (the
        defaults); ``engine_type`` and ``native`` override what ``source`` says."""
        source = {} if source is None else source
        name = str(engine_type or _read(source, "engine_type", "vllm")).strip().lower()
        if engine_type is not None:
            chosen = True
        elif isinstance(source, Mapping):
            chosen = "engine_type" in source
        elif hasattr(source, "model_fields_set"):  # a StrategyConfig: set, or defaulted?
            chosen = "engine_type" in source.model_fields_set
        else:
            chosen = hasattr(source, "engine_type")
        device = _read(source, "device", None)
        if device in (None, "auto"):
            device = "cuda" if cuda_available() else "cpu"
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        precision = _read(source, "precision", None)
        if precision is None:
            resolved = getattr(source, "resolved_precision", None)
            precision = resolved if isinstance(resolved, str) else None
        if precision is None:
            bf16 = _read(source, "bf16", True)
            precision = "bf16" if bf16 else ("fp16" if str(device).startswith("cuda") else "fp32")
        max_len = _read(source, "engine_max_model_len", None)
        if max_len is None:
            prompt, generate = (_read(source, k) for k in ("prompt_max_len", "generate_max_len"))
            if prompt is not None and generate is not None:
                max_len = int(prompt) + int(generate)
        sleep_level = None
        if _read(source, "enable_engine_sleep", False):
            sleep_level = int(_read(source, "engine_sleep_level", None) or 1)
        options = dict(_read(source, "engine_options", None) or {})
        options.update(native)
        model_path = _read(source, "pretrain", None)
        lora_rank = int(_read(source, "lora_rank", 0) or 0)
        adapters = lora_rank > 0 and _read(source, "lora_sync", "merged") == "adapter"
        targets = _read(source, "target_modules", None) or ["all-linear"]
        return cls(
            engine_type=name,
            model_path=None if model_path is None else str(model_path),
            tp_size=int(_read(source, "engine_tp_size", 1) or 1),
            mem_util=float(_read(source, "engine_mem_util", 0.5) or 0.5),
            max_model_len=None if max_len is None else int(max_len),
            dtype=_DTYPES.get(str(precision), str(precision)),
            sleep_level=sleep_level,
            seed=int(_read(source, "seed", 42)),
            device=str(device),
            native=options,
            lora_rank=lora_rank if adapters else None,
            lora_target_modules=tuple([targets] if isinstance(targets, str) else targets)
            if adapters
            else (),
            engine_type_chosen=chosen,
        )

    def require_model_path(self) -> str:
        if not self.model_path:
            raise ValueError(
                f"the {self.engine_type} engine needs the model to serve: set `pretrain` (a "
                "Hugging Face model directory or hub name) in the config or args namespace"
            )
        return self.model_path
