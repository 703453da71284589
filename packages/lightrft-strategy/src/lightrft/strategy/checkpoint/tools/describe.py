"""What a checkpoint directory holds, as plain JSON values (``lightrft ckpt info``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightrft.strategy.checkpoint.layout import (
    HF_CONFIG_FILE,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointDir,
    CheckpointError,
)
from lightrft.strategy.checkpoint.tokenizer import recorded_tokenizer_files
from lightrft.strategy.checkpoint.tools.offline import looks_like_tag


def _tag_entry(root: Path, tag: str) -> dict[str, Any]:
    """One tag: complete (every listed file present at its saved size) or why not."""
    try:
        info = CheckpointDir(root, rank=0, barrier=lambda: None).resolve(tag, backend=None)
    except CheckpointError as exc:
        return {"tag": tag, "path": str(root / tag), "complete": False, "problem": str(exc)}
    meta = info.metadata
    entry: dict[str, Any] = {
        "tag": tag,
        "path": str(info.path),
        "complete": True,
        "backend": meta.get("backend"),
        "world_size": meta.get("world_size"),
        "global_step": meta.get("global_step"),
        "size_bytes": info.size_bytes,
        "has_optimizer": bool(meta.get("has_optimizer")),
        "has_scheduler": bool(meta.get("has_scheduler")),
        "created_ns": meta.get("created_ns"),
        "versions": meta.get("versions", {}),
        "hf_config": (info.path / HF_CONFIG_FILE).is_file(),
        "tokenizer": bool(recorded_tokenizer_files(info)),
    }
    backend_info = meta.get("backend_info") or {}
    if meta.get("backend") == "deepspeed":
        entry["zero_stage"] = backend_info.get("zero_stage")
        entry["precision"] = backend_info.get("precision")
        entry["layout"] = f"DeepSpeed ZeRO stage {backend_info.get('zero_stage')} engine files"
    elif meta.get("backend") == "fsdp2":
        shards = sorted(p.name for p in (info.path / "dcp").glob("*.distcp"))
        entry["layout"] = (
            f"torch.distributed.checkpoint, {len(shards)} shard file(s); loads at any world size"
        )
    model = meta.get("model")
    if isinstance(model, dict):
        params = model.get("parameters", [])
        entry["model_class"] = model.get("class")
        entry["parameters"] = len(params)
        entry["numel"] = sum(_numel(p[1]) for p in params)
        entry["dtypes"] = sorted({str(p[2]) for p in params})
    entry["optimizer"] = meta.get("optimizer")
    return entry


def _numel(shape: list[int]) -> int:
    total = 1
    for n in shape:
        total *= int(n)
    return total


def describe(path: str | Path) -> dict[str, Any]:
    """Every checkpoint under a ``save_dir`` (or the one tag directory ``path``), with
    which tag ``latest`` names, and stale partial saves."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give a save_dir or a tag directory")
    if (path / METADATA_FILE).is_file() or (
        looks_like_tag(path) and not (path / LATEST_FILE).is_file()
    ):
        root, names = path.parent, [path.name]  # one tag directory, complete or not
    else:
        root = path
        names = sorted(
            p.name
            for p in path.iterdir()
            if p.is_dir() and not p.name.startswith(".")
            and ((p / METADATA_FILE).is_file() or looks_like_tag(p))
        )  # fmt: skip
    tags = [_tag_entry(root, name) for name in names]
    latest_file = root / LATEST_FILE
    latest = latest_file.read_text(encoding="utf-8").strip() if latest_file.is_file() else None
    partial = sorted(
        p.name[1:].removesuffix(".partial") for p in root.glob(".*.partial") if p.is_dir()
    )
    if not tags and not partial:
        raise CheckpointError(
            f"{path} holds no LightRFT checkpoint (no tag directory with {METADATA_FILE})"
        )
    complete = [t for t in tags if t["complete"]]
    complete.sort(key=lambda t: (t.get("global_step") or 0, t.get("created_ns") or 0))
    return {
        "save_dir": str(root),
        "latest": latest,
        "latest_complete": any(t["tag"] == latest and t["complete"] for t in tags),
        "tags": tags,
        "interrupted_saves": partial,
        "newest_complete": complete[-1]["tag"] if complete else None,
    }
