"""Reading a checkpoint in one process, without the world that saved it.

:func:`open_checkpoint` finds and verifies a checkpoint (a ``save_dir`` through its
``latest``, or a tag directory); :func:`read_contents` gives its full, unsharded state
by the model's parameter names, whatever backend wrote it:

- ``weights``: every saved tensor of the model (parameters and persistent buffers),
  full shape, as saved (FSDP2: the sharded parameters' dtype; DeepSpeed: the fp32
  master weights);
- ``optimizer``: per parameter name the optimizer's state (``step``, ``exp_avg``,
  ``exp_avg_sq`` for Adam), and the parameter groups' hyperparameters with the names of
  their parameters in order.

This is what ``lightrft ckpt export`` and ``lightrft ckpt convert`` build on.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightrft.strategy.checkpoint.layout import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointDir,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
)
from lightrft.strategy.checkpoint.tools.contents import CheckpointContents, OptimizerContents

__all__ = [
    "DCP_DIR",
    "CheckpointContents",
    "OptimizerContents",
    "looks_like_tag",
    "open_checkpoint",
    "read_contents",
    "read_dcp",
]

DCP_DIR = "dcp"  # the FSDP2 backend's directory inside a tag


def open_checkpoint(path: str | Path, tag: str | None = None) -> CheckpointInfo:
    """The checkpoint at ``path``: a tag directory (holding the metadata file), or a
    ``save_dir`` (then ``tag``, else the one ``latest`` names). Verified complete, every
    file of the size it was saved with; any backend."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist")
    if tag is None and (path / METADATA_FILE).is_file():
        return CheckpointDir(path.parent, rank=0, barrier=lambda: None).resolve(
            path.name, backend=None
        )
    if tag is None and not (path / LATEST_FILE).is_file() and looks_like_tag(path):
        # a tag directory whose save never finished: say so, rather than "no latest"
        return CheckpointDir(path.parent, rank=0, barrier=lambda: None).resolve(
            path.name, backend=None
        )
    return CheckpointDir(path, rank=0, barrier=lambda: None).resolve(tag, backend=None)


def looks_like_tag(path: Path) -> bool:
    """Whether ``path`` holds the files of a checkpoint tag (ours or DeepSpeed's)."""
    if not path.is_dir():
        return False
    ours = ("steps.json", "rng", "client_state.pt", DCP_DIR)
    return any((path / name).exists() for name in ours) or any(path.glob("*model_states.pt"))


def read_contents(
    info: CheckpointInfo,
    *,
    optimizer: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> CheckpointContents:
    """The full state of the checkpoint ``info`` (see the module's docstring);
    ``progress("read", files done, files)`` as the backend's files are read."""
    backend = info.metadata.get("backend")
    if backend == "fsdp2":
        if progress is not None:
            progress("read", 0, 1)
        contents = _read_fsdp2(info, optimizer)
        if progress is not None:
            progress("read", 1, 1)
        return _complete(contents)
    if backend == "deepspeed":
        from lightrft.strategy.checkpoint.tools.deepspeed_files import read_deepspeed

        return _complete(read_deepspeed(info, optimizer, progress))
    raise CheckpointError(
        f"{info.path} was saved by the {backend!r} backend, which keeps no files this "
        "command can read; only fsdp2 and deepspeed checkpoints can be exported or converted"
    )


def _complete(contents: CheckpointContents) -> CheckpointContents:
    """Refuse contents lacking a parameter or buffer the model recorded (rather than
    export or convert a model with a weight left out)."""
    model = contents.info.metadata.get("model")
    if not isinstance(model, dict):
        return contents
    tied = model.get("tied") or {}
    expected = [str(e[0]) for e in [*model.get("parameters", []), *model.get("buffers", [])]]
    missing = [name for name in expected if name not in contents.weights and name not in tied]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise CheckpointError(
            f"{contents.info.path}: the model recorded {len(missing)} tensor(s) its files do "
            f"not hold ({shown}); nothing was written. The files are incomplete, or hold "
            "state in a form this command does not read"
        )
    return contents


# -- FSDP2: a torch.distributed.checkpoint directory -------------------------------------


def _dcp_planner() -> Any:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class _PlainPlanner(_EmptyStateDictLoadPlanner):
        """Rebuilds the saved state dict from the metadata; the non-tensor values (the
        optimizer's hyperparameters) are read with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return _PlainPlanner()  # type: ignore[no-untyped-call]


def read_dcp(directory: Path) -> dict[str, Any]:
    """A whole DCP checkpoint as one nested state dict of full tensors, in one process."""
    # The public load() fills only keys already present; its worker fills an empty
    # dict from the metadata (as torch's own dcp_to_torch_save does).
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lightrft.strategy.checkpoint.safe_io import SafeFileSystemReader

    state: dict[str, Any] = {}
    try:
        # read the metadata first: a corrupt one is named as such, not as a missing file
        SafeFileSystemReader(directory).read_metadata()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            _load_state_dict(
                state,
                storage_reader=SafeFileSystemReader(directory),
                planner=_dcp_planner(),
                no_dist=True,
            )
    # DCP's CheckpointException derives from BaseException, not Exception
    except (Exception, CheckpointException) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f"cannot read the DCP files in {directory} ({type(exc).__name__}: {first}); the "
            "checkpoint is corrupt: load an earlier tag"
        ) from exc
    return state


def _read_fsdp2(info: CheckpointInfo, optimizer: bool) -> CheckpointContents:
    state = read_dcp(info.path / DCP_DIR)
    weights = {name: tensor for name, tensor in state.get("model", {}).items()}
    contents = CheckpointContents(info, weights)
    saved = state.get("optim")
    if optimizer and saved is not None:
        contents.optimizer = OptimizerContents(
            state={name: dict(values) for name, values in saved.get("state", {}).items()},
            param_groups=[dict(group) for group in saved.get("param_groups", [])],
        )
    return contents
