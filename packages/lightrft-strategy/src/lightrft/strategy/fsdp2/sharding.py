"""How FSDP2 lays a model over the ranks: which blocks, which mesh, which dtypes."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from lightrft.strategy import roll_call
from lightrft.strategy.precision import compute_dtype


def wrap_targets(model: nn.Module, class_names: list[str] | None) -> list[nn.Module]:
    """The blocks to shard one by one: modules whose class is in ``class_names`` (else
    the model's ``_no_split_modules``); with neither, every element of every
    ``nn.ModuleList`` (a transformer's layers)."""
    names = class_names or list(getattr(model, "_no_split_modules", None) or [])
    if names:
        wanted = set(names)
        found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"fsdp_wrap_modules={sorted(wanted)} matches no module of "
                f"{type(model).__name__}; its module classes are: {', '.join(present)}"
            )
        return found
    return [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]


def build_mesh(world_size: int, shard_size: int | None, device_type: str) -> DeviceMesh:
    """1-D mesh (shard over every rank) or, with ``shard_size``, the 2-D HSDP mesh
    (``replicate`` x ``shard``): shard within groups of ``shard_size`` ranks."""
    if shard_size is None or shard_size == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Compute in ``precision``; reduce gradients in fp32."""
    param_dtype = compute_dtype(precision)
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    precision: str,
    cpu_offload: bool,
    reshard_after_forward: bool,
    class_names: list[str] | None,
) -> nn.Module:
    """``fully_shard`` each block, then the root (which holds what is left).

    On a mesh whose shard groups are one rank (``fsdp_shard_size: 1``, or one process)
    nothing is sharded: per-block groups would save no memory and cost one gradient
    all-reduce per block, so only the root is wrapped (one all-reduce per step, as DDP
    does for a model in one bucket) unless ``class_names`` names the blocks."""
    # Pinned host memory needs CUDA; on a CPU-only job the offload path still runs.
    pin = mesh.device_type == "cuda"
    offload = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    replicated = mesh.size(mesh.ndim - 1) == 1
    blocks = [] if replicated and not class_names else wrap_targets(model, class_names)
    for module in [*blocks, model]:
        # The root's parameters are gathered again at once for backward: with the
        # setting on, leave the root to torch's rule (None: the root keeps them), which
        # saves one all-gather per micro-batch (measured in benchmarks/fsdp2_overhead.py).
        after_forward: bool | None = reshard_after_forward
        if module is model and reshard_after_forward:
            after_forward = None
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=mixed_precision(precision),
            offload_policy=offload,
            reshard_after_forward=after_forward,
        )
        roll_call.guard_fsdp_forward(module, root=module is model)
    return model
