"""This rank's random-number state (python, numpy when installed, torch CPU and CUDA),
as plain values that ``torch.load(weights_only=True)`` reads back."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        as_int64 = np.asarray(keys, dtype=np.int64)
        state["numpy"] = [name, torch.from_numpy(as_int64), pos, has_gauss, cached]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    if "numpy" in state and importlib.util.find_spec("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
