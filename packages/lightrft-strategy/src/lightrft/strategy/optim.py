"""Optimizer parameter groups and learning-rate schedules shared by every backend."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightrft.config import StrategyConfig
from lightrft.strategy.tensors import full_shape

#: Parameter names containing one of these never get weight decay (upstream's rule).
NO_DECAY_NAME_PARTS = (
    "bias",
    "layer_norm.weight",
    "layernorm.weight",
    "norm.weight",
    "ln_f.weight",
)


def _is_norm(module: nn.Module) -> bool:
    kinds = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm)
    return isinstance(module, kinds) or "norm" in type(module).__name__.lower()


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed weights, and biases/norm weights/1-d params without decay.

    Only parameters that require grad are included; the split is by module type and
    by upstream's name patterns, so HF models and plain torch modules agree.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if _is_norm(module):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        ndim = len(full_shape(param))  # a ZeRO-3 parameter's data is an empty shard
        if (
            id(param) in no_decay_ids
            or ndim <= 1
            or any(part in lowered for part in NO_DECAY_NAME_PARTS)
        ):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_adamw(
    params: Iterable[dict[str, Any]], *, lr: float, betas: tuple[float, float], **kwargs: Any
) -> torch.optim.AdamW:
    """AdamW; fused/foreach left to torch's defaults for the parameters' device."""
    return torch.optim.AdamW(list(params), lr=lr, betas=betas, **kwargs)


def _warmup_then(step: int, *, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    if step < warmup:  # from 0, as transformers' get_scheduler (upstream's) warms up
        return step / warmup
    if kind == "constant_with_warmup":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "cosine":
        return cosine
    return min_ratio + (1.0 - min_ratio) * cosine  # cosine_with_min_lr


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: StrategyConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The configured schedule over ``max_steps`` optimizer steps: linear warmup from 0
    for ``ceil(max_steps * lr_warmup_ratio)`` steps, then ``config.lr_scheduler``.

    The values are those of transformers' ``get_scheduler`` of the same name, which
    upstream uses (its default, ``cosine_with_min_lr``, decays to ``min_lr_ratio``, 0.1,
    of the peak learning rate), except past ``max_steps``, where the schedule holds its
    last value instead of following the cosine back up.
    """
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1 to build a learning-rate schedule")
    warmup = min(max_steps, math.ceil(max_steps * config.lr_warmup_ratio))
    rule = functools.partial(
        _warmup_then,
        warmup=max(1, warmup) if warmup else 0,
        total=max_steps,
        kind=config.lr_scheduler,
        min_ratio=config.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, rule)
