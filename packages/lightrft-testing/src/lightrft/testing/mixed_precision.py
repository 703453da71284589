"""Mixed precision for :class:`~lightrft.testing.FakeStrategy`, as FSDP2 does it.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps fp32
parameters (the optimizer's masters), casts them and floating-point inputs to bf16 for
the forward, and hands fp32 gradients to the optimizer. :class:`LowPrecisionCompute`
does the same on one process, so a fake configured with ``bf16=True`` (the default)
trains with the numerics of the real backends instead of in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from lightrft.strategy.precision import compute_dtype


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


class LowPrecisionCompute(nn.Module):
    """Runs ``module`` in ``dtype``; its parameters stay in their own (fp32) dtype.

    The forward casts every floating-point parameter and input to ``dtype`` (buffers
    are left as they are, as FSDP2 leaves them); autograd casts the gradients back, so
    they reach the fp32 parameters in fp32. ``.module`` is the user's model:
    ``strategy.unwrap_model`` returns it, and state dicts, checkpoints and exports see
    only fp32 weights.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = {
            name: param.to(self.dtype) if param.is_floating_point() else param
            for name, param in self.module.named_parameters()
        }
        return functional_call(
            self.module, params, _cast(args, self.dtype), _cast(kwargs, self.dtype), strict=False
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the model's own attributes (config, generate...)
            return getattr(self.__dict__["_modules"]["module"], name)


def with_compute_precision(module: nn.Module, precision: str) -> nn.Module:
    """``module`` wrapped to compute in ``precision`` ("bf16", "fp16"), or itself for
    "fp32" and for a module already wrapped."""
    dtype = compute_dtype(precision)
    if dtype is None or isinstance(module, LowPrecisionCompute):
        return module
    return LowPrecisionCompute(module, dtype)
