"""The checkpoint directory protocol every backend shares.

    save_dir/
      latest                      names the newest complete tag (replaced atomically)
      <tag>/                      one checkpoint: backend-native state + our pieces
        lightrft_checkpoint.json  metadata, written last: a tag without it is incomplete
      .<tag>.partial/             a save in progress (renamed to <tag> when complete)

A save writes into ``.<tag>.partial``; only when every rank has finished does rank 0
write the metadata (with every file's size), rename the directory to ``<tag>`` and
replace ``latest``. A save killed half-way therefore leaves the previous checkpoint,
and ``latest``, untouched. Rotation deletes only directories holding our metadata.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METADATA_FILE = "lightrft_checkpoint.json"
LATEST_FILE = "latest"
HF_CONFIG_FILE = "hf_config.json"  # the model's Hugging Face config (see .manager)
TOKENIZER_DIR = "tokenizer"  # the tokenizer's save_pretrained files (see .tokenizer)
PARTIAL_MARKER = ".lightrft_partial"
FORMAT_VERSION = 1
GIB = 2**30
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which and why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint where one was asked for."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory exists but its save never finished, or a file was cut short."""


class ForeignCheckpointError(CheckpointError):
    """The checkpoint was written by another backend, or not by LightRFT at all."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    tag: str
    metadata: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return sum(int(size) for size in self.metadata.get("files", {}).values())


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag) or tag == LATEST_FILE:
        raise ValueError(
            f"checkpoint tag {tag!r} is not a plain directory name; use letters, digits and "
            "_ . + = - (not starting with '.', and not 'latest'), e.g. 'global_step100'"
        )
    return tag


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in (METADATA_FILE, PARTIAL_MARKER)
    }


def _read_metadata(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT_VERSION else None


class CheckpointDir:
    """One ``save_dir``, seen from one rank. ``barrier`` synchronises all ranks."""

    def __init__(self, root: str | os.PathLike[str], *, rank: int, barrier: Callable[[], None]):
        self.root = Path(root)
        self.rank = rank
        self.barrier = barrier

    # -- saving ------------------------------------------------------------------------
    def begin(self, tag: str) -> Path:
        """Create ``.<tag>.partial`` (clearing a stale one) and return it on every rank."""
        staging = self.root / f".{check_tag(tag)}.partial"
        existing = self.root / tag
        if existing.exists() and _read_metadata(existing) is None:
            raise CheckpointError(
                f"{existing} exists and is not a LightRFT checkpoint; saving tag {tag!r} "
                "would replace it. Choose another tag or save_dir"
            )
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
            (staging / PARTIAL_MARKER).write_text("a LightRFT checkpoint save in progress\n")
        self.barrier()
        return staging

    def commit(
        self, tag: str, staging: Path, metadata: dict[str, Any], *, update_latest: bool = True
    ) -> Path:
        """Seal the checkpoint once every rank has written its part: metadata last,
        then the rename, then (unless ``update_latest`` is false) ``latest``."""
        self.barrier()
        final = self.root / tag
        if self.rank == 0:
            existing = [info.metadata.get("sequence", 0) for info in self.complete()]
            meta = {
                "format": FORMAT_VERSION,
                "tag": tag,
                "created_ns": time.time_ns(),
                "sequence": max(existing, default=0) + 1,
                **metadata,
                "files": _file_sizes(staging),
            }
            _write_atomic(staging / METADATA_FILE, json.dumps(meta, indent=2, sort_keys=True))
            (staging / PARTIAL_MARKER).unlink()
            if final.exists():
                retired = self.root / f".{tag}.retired-{time.time_ns()}"
                os.replace(final, retired)
                os.replace(staging, final)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                os.replace(staging, final)
            if update_latest:
                _write_atomic(self.root / LATEST_FILE, tag + "\n")
        self.barrier()
        return final

    # -- listing and rotation ------------------------------------------------------------
    def complete(self) -> list[CheckpointInfo]:
        """Complete checkpoints written by LightRFT, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            if child.is_dir() and not child.name.startswith("."):
                meta = _read_metadata(child)
                if meta is not None:
                    found.append(CheckpointInfo(child, child.name, meta))
        return sorted(
            found, key=lambda i: (i.metadata.get("sequence", 0), i.metadata["created_ns"])
        )

    def rotate(self, max_num: int, max_mem_gib: float, newest: str) -> list[str]:
        """On rank 0: delete the oldest complete checkpoints until at most ``max_num``
        remain and they total at most ``max_mem_gib`` GiB. The tag ``newest`` (the one
        just saved) and the tag ``latest`` names are never deleted, nor is any directory
        without our metadata. Returns the deleted tags."""
        if self.rank != 0:
            return []
        if max_num < 1:
            raise ValueError(f"max_num={max_num} must be >= 1: the newest checkpoint is kept")
        kept = self.complete()
        latest_file = self.root / LATEST_FILE
        protected = {newest}
        if latest_file.is_file():
            protected.add(latest_file.read_text(encoding="utf-8").strip())
        deleted: list[str] = []
        while len(kept) > 1 and (
            len(kept) > max_num or sum(i.size_bytes for i in kept) > max_mem_gib * GIB
        ):
            oldest = next((i for i in kept if i.tag not in protected), None)
            if oldest is None:
                break
            shutil.rmtree(oldest.path)
            kept.remove(oldest)
            deleted.append(oldest.tag)
        if deleted:
            logger.info("checkpoint rotation in %s deleted %s", self.root, ", ".join(deleted))
        return deleted

    # -- loading -------------------------------------------------------------------------
    def resolve(self, tag: str | None, *, backend: str | None) -> CheckpointInfo:
        """The checkpoint to load (``tag``, else the one ``latest`` names), verified: it
        is complete, every file has the size it was saved with, and ``backend`` wrote it
        (any backend when ``backend`` is None)."""
        if not self.root.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint directory at {self.root}")
        if tag is None:
            latest = self.root / LATEST_FILE
            if not latest.is_file():
                complete = self.complete()
                if not complete:
                    raise CheckpointNotFoundError(
                        f"no checkpoint in {self.root}: no '{LATEST_FILE}' file and no "
                        f"directory with {METADATA_FILE}"
                    )
                tag = complete[-1].tag
            else:
                tag = latest.read_text(encoding="utf-8").strip()
        path = self.root / check_tag(tag)
        if not path.is_dir():
            partial = self.root / f".{tag}.partial"
            hint = " (a save of it was interrupted)" if partial.exists() else ""
            raise CheckpointNotFoundError(f"no checkpoint '{tag}' in {self.root}{hint}")
        if not (path / METADATA_FILE).is_file():
            if any(path.glob("mp_rank_*_model_states.pt")) or any(path.glob("*model_states.pt")):
                raise ForeignCheckpointError(
                    f"{path} is a plain DeepSpeed checkpoint without {METADATA_FILE}; load it "
                    "with DeepSpeed itself, or save it again through a LightRFT strategy"
                )
            raise IncompleteCheckpointError(
                f"{path} has no {METADATA_FILE}: its save did not finish (or it was not "
                "written by LightRFT); load an earlier tag"
            )
        meta = _read_metadata(path)
        if meta is None:
            raise IncompleteCheckpointError(
                f"{path / METADATA_FILE} is unreadable or of an unknown format version "
                f"(this LightRFT reads format {FORMAT_VERSION})"
            )
        if backend is not None and meta.get("backend") != backend:
            raise ForeignCheckpointError(
                f"{path} was saved by the {meta.get('backend')!r} backend; this strategy is "
                f"{backend!r}. Load it with backend={meta.get('backend')!r}, or export the "
                "weights with save_model and start a new run from them"
            )
        for name, size in meta.get("files", {}).items():
            file = path / name
            if not file.is_file():
                raise IncompleteCheckpointError(f"{path} is missing {name} (listed in metadata)")
            if file.stat().st_size != size:
                raise IncompleteCheckpointError(
                    f"{file} has {file.stat().st_size} bytes, but {size} were saved: the file "
                    "is truncated or was changed"
                )
        return CheckpointInfo(path, tag, meta)
