"""Writing a full state dict in Hugging Face format: safetensors shards, an index when
sharded, the model's config and the tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 2**30


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each parameter name after the first that names the same parameter -> the first."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _drop_tied_duplicates(
    state: dict[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """Drop the second name of each tied parameter (HF re-ties them on load, and every
    backend's full state dict then writes the same names, whether or not its gathered
    tensors share memory); safetensors refuses tensors sharing memory, so of the
    remaining names keep the first of each storage, dropping names the model declares
    tied and cloning others."""
    aliases = set(tied_aliases(model))
    state = {name: tensor for name, tensor in state.items() if name not in aliases}
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            raise ValueError(f"save_model: tensor {name!r} is on the meta device (never loaded)")
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(int(n) for n in tensor.shape),
        )
        if key in seen:
            if name in tied or any(name.endswith(t) for t in tied):
                continue
            tensor = tensor.clone()
        else:
            seen[key] = name
        out[name] = tensor.contiguous()
    return out


def write_weight_files(
    tensors: dict[str, torch.Tensor], output_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[Path]:
    """``model.safetensors``, or numbered shards of at most ``max_shard_bytes`` plus
    ``model.safetensors.index.json``; earlier weight files in ``output_dir`` are removed
    first. Tensors must not share memory. Returns the files written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*output_dir.glob("model*.safetensors"), *output_dir.glob("model*.index.json")]:
        stale.unlink()  # a previous export's weights must not mix with this one
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    files: list[Path] = []
    if len(shards) == 1:
        files.append(output_dir / "model.safetensors")
        save_file(shards[0], files[0], metadata={"format": "pt"})
        return files
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = output_dir / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, file, metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(shard, file.name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return files


def write_hf_checkpoint(
    state: dict[str, torch.Tensor],
    model: nn.Module,
    output_dir: Path,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    **_: Any,
) -> list[Path]:
    """Write ``state`` as ``model.safetensors`` (or numbered shards plus
    ``model.safetensors.index.json``), then config.json / generation_config.json when
    the model has them, then the tokenizer's files. Returns the weight files."""
    files = write_weight_files(_drop_tied_duplicates(state, model), output_dir, max_shard_bytes)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(output_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "save_pretrained"):
        generation_config.save_pretrained(output_dir)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(output_dir)
    logger.info("saved %d weight file(s) to %s", len(files), output_dir)
    return files
