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


def cpu_bf16_kernels() -> str | None:
    """Which bfloat16 matrix instructions this CPU has, as oneDNN uses them: ``"AMX"``
    (AMX tiles, Sapphire Rapids and later), ``"AVX512-BF16"`` (Cooper Lake, Zen 4 and
    later), or None where bf16 would be emulated in fp32 (no faster, and rounded).

    Read from torch's own CPU checks (``torch.cpu``), or, on a torch without them, from
    the flags the Linux kernel lists in ``/proc/cpuinfo``.
    """
    names = ("amx_tile", "avx512_bf16")
    checks = [getattr(torch.cpu, f"_is_{name}_supported", None) for name in names]
    if all(callable(check) for check in checks):
        amx, avx512_bf16 = (bool(check()) for check in checks)  # type: ignore[misc]
    else:  # pragma: no cover - torch < 2.3
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
                flags = next((line.split() for line in cpuinfo if line.startswith("flags")), [])
        except OSError:
            flags = []
        amx, avx512_bf16 = "amx_bf16" in flags, "avx512_bf16" in flags
    if amx:
        return "AMX"
    return "AVX512-BF16" if avx512_bf16 else None
