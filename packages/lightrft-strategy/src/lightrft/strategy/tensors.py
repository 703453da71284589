"""Facts about a parameter that hold on every backend, sharded or not."""

from __future__ import annotations

import torch

__all__ = ["full_shape"]


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of a parameter (DeepSpeed ZeRO-3 keeps it in ``ds_shape``;
    an FSDP2 DTensor's shape is already the global one)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(int(n) for n in (shape if shape is not None else param.shape))
