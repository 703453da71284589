"""What each ``resolved_precision`` computes in: the one map every backend reads."""

from __future__ import annotations

import torch

#: Compute dtype of each precision; None: compute in the parameters' own dtype (fp32).
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": None,
}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype a model computes in at ``precision`` ("bf16", "fp16", "fp32")."""
    try:
        return COMPUTE_DTYPES[precision]
    except KeyError:
        raise ValueError(
            f"precision={precision!r} is not one of {', '.join(COMPUTE_DTYPES)}"
        ) from None
