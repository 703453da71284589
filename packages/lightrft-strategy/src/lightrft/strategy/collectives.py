"""all_reduce / all_gather over tensors, Python numbers and dicts of them.

What goes in comes back in the same shape: a tensor stays a tensor on its own device
and dtype, a number stays a Python number, a dict stays a dict with the same keys.
Without a process group (or at world size 1) the values come back unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

ReduceOp = Literal["mean", "max", "min", "sum"]
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm_device(tensor: torch.Tensor) -> torch.device:
    # A CUDA group ("cpu:gloo,cuda:nccl") moves CUDA tensors over NCCL and CPU ones over
    # gloo; a gloo-only group needs CPU tensors.
    if tensor.device.type == "cuda" and "nccl" in str(dist.get_backend()).lower():
        return tensor.device
    return torch.device("cpu")


def all_reduce(data: Any, op: ReduceOp = "mean") -> Any:
    """Reduce ``data`` over all ranks with ``op`` (``mean``, ``max``, ``min``, ``sum``).

    ``int`` inputs come back as ``int`` for ``sum``/``max``/``min`` and as ``float`` for
    ``mean``; ``float`` and ``bool``-free numbers as ``float``; tensors keep dtype
    (integer tensors under ``mean`` become floating, as a mean must). A dict's numbers
    travel together in one collective (float64); its tensors one by one.
    """
    if op not in ("mean", "max", "min", "sum"):
        raise ValueError(f"all_reduce op={op!r} is not one of 'mean', 'max', 'min', 'sum'")
    if isinstance(data, dict):  # sorted: every rank must reduce the same key together
        numbers = [k for k in sorted(data) if _is_number(data[k])]
        out = {key: all_reduce(data[key], op) for key in sorted(data) if key not in numbers}
        if numbers:  # a dict's numbers (a step's metrics) in one collective
            values = torch.tensor([float(data[k]) for k in numbers], dtype=torch.float64)
            together: list[float] = _reduce_tensor(values, op).tolist()
            for key, value in zip(numbers, together, strict=True):
                keep_int = isinstance(data[key], int) and op != "mean"
                out[key] = round(value) if keep_int else float(value)
        return {key: out[key] for key in sorted(data)}
    if isinstance(data, torch.Tensor):
        return _reduce_tensor(data, op)
    if isinstance(data, bool) or not isinstance(data, int | float):
        raise TypeError(
            f"all_reduce takes tensors, int/float numbers or dicts of them, got "
            f"{type(data).__name__}"
        )
    reduced = _reduce_tensor(torch.tensor([data], dtype=torch.float64), op).item()
    if isinstance(data, int) and op != "mean":
        return round(reduced)
    return float(reduced)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _reduce_tensor(tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    world = _world()
    work = tensor.detach()
    if op == "mean" and not (work.is_floating_point() or work.is_complex()):
        work = work.double()
    if world == 1:
        return work.clone()  # never an alias of the input
    device = _comm_device(work)
    buffer = work.to(device, copy=True)
    dist.all_reduce(buffer, op=_OPS[op])
    if op == "mean":
        buffer /= world
    out = buffer.to(tensor.device)
    return out if op == "mean" else out.to(tensor.dtype)


def all_gather(data: Any) -> Any:
    """Gather ``data`` from all ranks, in rank order.

    A tensor comes back as the ranks' tensors concatenated along dim 0 (ranks may hold
    different lengths along dim 0); a number as a list with one entry per rank; a dict
    as a dict of gathered values.
    """
    if isinstance(data, dict):
        return {key: all_gather(data[key]) for key in sorted(data)}
    if isinstance(data, torch.Tensor):
        return _gather_tensor(data)
    if isinstance(data, bool | int | float):
        world = _world()
        if world == 1:
            return [data]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, data)
        return gathered
    raise TypeError(
        f"all_gather takes tensors, numbers or dicts of them, got {type(data).__name__}"
    )


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    world = _world()
    work = tensor.detach()
    if work.dim() == 0:  # a 0-d tensor gathers to shape (world,) at every world size
        work = work.reshape(1)
    if world == 1:
        return work.clone()
    device = _comm_device(work)
    work = work.to(device)
    length = torch.tensor([work.shape[0]], device=device, dtype=torch.long)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = int(max(n.item() for n in lengths))
    padded = torch.zeros((longest, *work.shape[1:]), dtype=work.dtype, device=device)
    padded[: work.shape[0]] = work
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.cat([part[: int(n.item())] for part, n in zip(parts, lengths, strict=True)])
    return out.to(tensor.device)
