"""Reading a model's full weights from disk for :meth:`StrategyBase.load_model`, without
unpickling arbitrary objects.

Accepted: a ``torch.save``'d state dict (read with ``weights_only=True``), a
``.safetensors`` file, or a directory in Hugging Face layout (``model.safetensors``,
sharded safetensors with ``model.safetensors.index.json``, or ``pytorch_model.bin``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightrft.strategy.checkpoint.layout import CheckpointError

_HF_FILES = ("model.safetensors", "pytorch_model.bin")
_HF_INDEX = "model.safetensors.index.json"


def _read_safetensors(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    device = str(map_location) if map_location is not None else "cpu"
    return load_file(str(path), device=device)


def _read_torch(path: Path, map_location: Any) -> Any:
    return torch.load(path, map_location=map_location, weights_only=True)


def _read_file(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            state: Any = _read_safetensors(path, map_location)
        else:
            state = _read_torch(path, map_location)
    except Exception as exc:  # corrupt, truncated, or a pickle of objects
        first = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"load_model: cannot read weights from {path} ({type(exc).__name__}: {first}); "
            "pass a state dict saved with torch.save, a .safetensors file or a Hugging "
            "Face model directory (files holding Python objects are refused)"
        ) from exc
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(
            f"load_model: {path} holds a {type(state).__name__}, not a state dict of named "
            "tensors; save model.state_dict() (or a lightrft checkpoint, loaded with "
            "strategy.load_ckpt) instead"
        )
    return dict(state)


def some_names(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``names``, comma-separated, with "..." when there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def read_weights(path: str | Path, map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    """All named tensors stored at ``path`` (file or Hugging Face directory)."""
    path = Path(path)
    if path.is_file():
        return _read_file(path, map_location)
    if not path.is_dir():
        raise FileNotFoundError(
            f"load_model: {path} does not exist; pass a weights file (.pt, .bin, "
            ".safetensors) or a Hugging Face model directory"
        )
    index = path / _HF_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(_read_file(path / shard, map_location))
        return state
    for name in _HF_FILES:
        if (path / name).is_file():
            return _read_file(path / name, map_location)
    raise CheckpointError(
        f"load_model: {path} is a directory without {', '.join((*_HF_FILES, _HF_INDEX))}; "
        "for a lightrft checkpoint directory use strategy.load_ckpt"
    )
