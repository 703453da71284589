"""Reading and writing checkpoint pieces without unpickling arbitrary objects.

Small state (scheduler, RNG, client_state) goes through ``torch.save`` and comes back
through ``torch.load(weights_only=True)``; DCP's own ``.metadata`` pickle is read by an
unpickler that only accepts the classes DCP writes there.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size)


def check_plain(value: Any, where: str = "client_state") -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` could not
    give back: only tensors, numbers, strings, None and lists/tuples/dicts of them."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"{where} is a {type(value).__name__}; checkpoints hold only tensors, numbers, "
            "strings, None and lists/tuples/dicts of them (loading never unpickles objects)"
        )


def save_plain(value: Any, path: Path, where: str) -> None:
    check_plain(value, where)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)


def load_plain(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


_DCP_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or module == (
            "torch.distributed.checkpoint.metadata"
        ):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP metadata file never "
            "holds; refusing to load it (the file is corrupt or not a DCP checkpoint)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata load accepts only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP Metadata")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
