"""DeepSpeed's C++ ops on a CPU job: which of them a training run builds, and why none.

``deepspeed.init_distributed`` makes DeepSpeed's ``TorchBackend``, which on the CPU
accelerator JIT-compiles the ``deepspeed_shm_comm`` op (a shared-memory all-reduce) with
``torch.utils.cpp_extension`` the first time a machine runs it: 38 s on an idle 2-core
machine, and longer on a busy one, inside the first collective's timeout (a fresh CI
machine timed out there at 300 s, one rank compiling while the other waited in an
all-reduce). The op serves one call only, ``deepspeed.comm.inference_all_reduce``, which
DeepSpeed's AutoTP *inference* layers use; ZeRO training never calls it (its
collectives are torch.distributed's). So the DeepSpeed backend turns the op off on CPU
(:func:`skip_shm_comm_op`) before DeepSpeed's communication layer starts, and a first
job's time no longer depends on a compiler. Every other DeepSpeed op a CPU job could
need (CPU Adam) is not used here either: the backend trains with torch's AdamW off
CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

#: DeepSpeed's name of the shared-memory all-reduce op (``ShareMemCommBuilder.NAME``).
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Tell DeepSpeed the shared-memory all-reduce op is not to be built in this process.

    DeepSpeed reads ``deepspeed.ops.__compatible_ops__`` (one dict per process, probed
    on first access: edits to it persist) before building the op, and a ``False``
    there makes ``TorchBackend`` fall back to torch.distributed, as it does on a
    platform the op does not support.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def extensions_dir() -> Path:
    """Where ``torch.utils.cpp_extension`` keeps JIT-built ops (``TORCH_EXTENSIONS_DIR``,
    else its default under the user's cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def built_ops() -> list[str]:
    """The DeepSpeed ops already JIT-built under :func:`extensions_dir`, by name (each
    op's folder holds its ``.so``; the default root has one subfolder per Python and
    torch build)."""
    root = extensions_dir()
    libraries = [*root.glob("*/*.so"), *root.glob("*/*/*.so")]
    return sorted({so.parent.name for so in libraries if so.parent.name.startswith("deepspeed")})
