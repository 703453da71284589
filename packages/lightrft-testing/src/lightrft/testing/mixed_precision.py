"""Mixed precision for :class:`~lightrft.testing.FakeStrategy`, as FSDP2 does it.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps fp32
parameters (the optimizer's masters), casts them and floating-point inputs to bf16 for
the forward, and hands fp32 gradients to the optimizer. :func:`with_compute_precision`
does the same on one process, so a fake configured with ``bf16=True`` (the default)
trains with the numerics of the real backends instead of in fp32.

It works as FSDP2's ``fully_shard`` does, in place: the module keeps its class, its
attributes and its parameter names (``prepare(model)`` returns ``model`` itself, as
upstream's fake does), and forward hooks swap in low-precision copies of its
parameters for the duration of each forward (through the same re-parametrisation
``torch.func.functional_call`` uses).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless

from lightrft.strategy.precision import compute_dtype

_ATTR = "_lightrft_compute_dtype"


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _install(module: nn.Module, dtype: torch.dtype) -> None:
    # one stack per module: a re-entrant forward (a module calling itself) nests
    active: list[contextlib.ExitStack] = []

    def before(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        params = {
            name: param.to(dtype) if param.is_floating_point() else param
            for name, param in mod.named_parameters()
        }
        stack = contextlib.ExitStack()
        stack.enter_context(stateless._reparametrize_module(mod, params, tie_weights=True))
        active.append(stack)
        return _cast(args, dtype), _cast(kwargs, dtype)

    def after(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        del mod, args, kwargs
        if active:  # also after an exception in the forward (always_call)
            active.pop().close()
        return output

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True, always_call=True)
    setattr(module, _ATTR, dtype)


def compute_precision_of(module: nn.Module) -> torch.dtype | None:
    """The dtype :func:`with_compute_precision` set ``module`` to compute in, or None."""
    dtype = getattr(module, _ATTR, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def with_compute_precision(module: nn.Module, precision: str) -> nn.Module:
    """``module`` itself, set to compute in ``precision`` ("bf16", "fp16"): each forward
    casts its floating-point parameters and inputs to that dtype, parameters stay fp32
    and gradients reach them in fp32. "fp32", and a module already set, are left as
    they are."""
    dtype = compute_dtype(precision)
    if dtype is not None and compute_precision_of(module) is None:
        _install(module, dtype)
    return module
