"""Sequence-parallel groups and the tensor exchanges Ulysses attention is built from.

Names and meanings are upstream LightRFT's (``lightrft.strategy.utils.parallel_utils``,
which re-exports this module), so upstream's model patches run on them:

* the group: :func:`set_sequence_parallel_group` and its getters; with no group set
  (a process without a process group, such as the fake strategy's)
  the size is 1 and the rank 0;
* :class:`SPDataProcessor`: ``preprocess`` gathers the items of every rank of the
  group (so each rank holds the group's sequences), ``postprocess`` gives each rank its
  own share back; both are the identity at size 1, and for the strategy's own processor
  (``replicated``: its loader already gives the ranks of a group the same items);
* :func:`sp_slice_and_pad_input`: pad a ``[1, seq]`` row to a multiple of the group
  size and keep this rank's slice of it;
* :func:`gather_forward_split_backward_and_unpad` and :class:`_SeqAllToAll`: autograd
  functions whose backward is the matching inverse exchange.

The strategy builds the groups (``sp_size`` consecutive ranks) when it is set up and
sets ``strategy.sp_data_processor``; :mod:`lightrft.strategy.ulysses` splits the
sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightrft.strategy import distributed

_SEQUENCE_PARALLEL_GROUP: Any = None
#: The default process group the group above belongs to: once that world is destroyed
#: (a strategy closed, or a test tore the group down) the group is gone with it.
_WORLD_OF_GROUP: Any = None


def set_sequence_parallel_group(group: Any) -> None:
    """Make ``group`` this process's sequence-parallel group (None: no group)."""
    global _SEQUENCE_PARALLEL_GROUP, _WORLD_OF_GROUP
    _SEQUENCE_PARALLEL_GROUP = group
    _WORLD_OF_GROUP = dist.group.WORLD if group is not None and dist.is_initialized() else None


def get_sequence_parallel_group() -> Any:
    """This process's sequence-parallel group, or None when none is set (or the process
    group it was made in no longer exists)."""
    if _SEQUENCE_PARALLEL_GROUP is None:
        return None
    if not dist.is_initialized() or dist.group.WORLD is not _WORLD_OF_GROUP:
        set_sequence_parallel_group(None)  # a group of a world that was destroyed
        return None
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    """Ranks in the sequence-parallel group; 1 when none is set."""
    group = get_sequence_parallel_group()
    return 1 if group is None else dist.get_world_size(group)


def get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group; 0 when none is set."""
    group = get_sequence_parallel_group()
    return 0 if group is None else dist.get_rank(group)


def build_sequence_parallel_groups(sp_size: int) -> Any:
    """Create the groups of ``sp_size`` consecutive ranks (every rank creates every
    group, as ``new_group`` requires), set this rank's and return it. Collective. Without
    a process group, a size above 1 is refused and nothing is set."""
    if not dist.is_initialized():
        if sp_size > 1:
            raise RuntimeError(f"sp_size={sp_size} needs a process group; there is none")
        set_sequence_parallel_group(None)
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ValueError(f"sp_size={sp_size} does not divide the world size {world}")
    mine = None
    for first in range(0, world, sp_size):
        group = distributed.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = group
    set_sequence_parallel_group(mine)
    return mine


class SPDataProcessor:
    """Moves a rank's items to its sequence-parallel group and back.

    ``preprocess(items)`` returns the items of every rank of the group, in rank order
    (each rank then holds the same list); ``postprocess(items)`` returns this rank's
    equal share of such a list. Both return their argument at group size 1. The group
    is read when the processor is built.

    ``replicated=True`` (the strategy's ``sp_data_processor``): the ranks of a group
    already hold the same items (the strategy's loader gives a group one share, as one
    data-parallel replica), so both methods return their argument: gathering would
    repeat each item ``sp_size`` times.
    """

    def __init__(self, replicated: bool = False) -> None:
        self.sp_size = get_sequence_parallel_world_size()
        self.sp_group = get_sequence_parallel_group()
        self.sp_rank = get_sequence_parallel_rank()
        self.replicated = replicated

    def preprocess(self, data: Any) -> Any:
        if self.sp_size <= 1 or self.replicated:
            return data
        gathered: list[Any] = [None] * self.sp_size
        dist.all_gather_object(gathered, data, group=self.sp_group)
        return [item for items in gathered for item in items]

    def postprocess(self, data: Any) -> Any:
        if self.sp_size <= 1 or self.replicated:
            return data
        if len(data) % self.sp_size:
            raise ValueError(
                f"SPDataProcessor.postprocess: {len(data)} items do not split evenly over the "
                f"{self.sp_size} ranks of the sequence-parallel group"
            )
        share = len(data) // self.sp_size
        return data[self.sp_rank * share : (self.sp_rank + 1) * share]


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def sp_slice_and_pad_input(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Pad ``input_ids`` (``[batch, seq]``) on the right with zeros to a multiple of the
    group size and keep this rank's slice of the sequence; ``position_ids`` (``[1,
    seq]``) is padded with 0, 1, ... and not sliced (attention needs the global
    positions). Returns ``(input_ids, position_ids, pad_size)``."""
    size, rank = _group_size_rank(get_sequence_parallel_group())
    if position_ids is not None and (
        position_ids.size(0) != 1 or position_ids.size(1) != input_ids.size(1)
    ):
        raise ValueError(
            f"sp_slice_and_pad_input: position_ids {tuple(position_ids.shape)} must be "
            f"[1, {input_ids.size(1)}] (one packed row, as input_ids)"
        )
    if size <= 1:
        return input_ids, position_ids, 0
    pad = -input_ids.size(-1) % size
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        if position_ids is not None:
            extra = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
            position_ids = torch.cat([position_ids, extra.unsqueeze(0)], dim=-1)
    part = input_ids.size(-1) // size
    return input_ids[..., rank * part : (rank + 1) * part].contiguous(), position_ids, pad


def _split(input_: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """This rank's equal slice of ``input_`` along ``dim`` (a copy)."""
    size, rank = _group_size_rank(group)
    if size == 1:
        return input_
    if input_.size(dim) % size:
        raise ValueError(
            f"cannot split dimension {dim} of size {input_.size(dim)} evenly over {size} ranks"
        )
    return input_.chunk(size, dim=dim)[rank].contiguous().detach().clone()


def _gather(input_: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Every rank's ``input_`` concatenated along ``dim``, in rank order."""
    size, rank = _group_size_rank(group)
    if size == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(size)]
    dist.all_gather(parts, input_.contiguous(), group=group)
    parts[rank] = input_  # keeps this rank's slice in the autograd graph's value
    return torch.cat(parts, dim=dim).contiguous()


class _GatherForwardSplitBackward(torch.autograd.Function):
    """Forward: gather along ``dim``; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(input_, group, dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, None, None]:
        return _split(grad_output, ctx.group, ctx.dim), None, None


def gather_forward_split_backward_and_unpad(
    input_: torch.Tensor,
    group: Any,
    dim: int,
    padding_size: int = 0,
    unpad_dim: int | None = None,
) -> torch.Tensor:
    """Gather ``input_`` along ``dim`` (gradients split back), then drop the last
    ``padding_size`` entries along ``unpad_dim``."""
    gathered: torch.Tensor = _GatherForwardSplitBackward.apply(input_, group, dim)
    if not padding_size:
        return gathered
    index: list[slice] = [slice(None)] * gathered.dim()
    index[dim if unpad_dim is None else unpad_dim] = slice(0, -padding_size)
    return gathered[tuple(index)]


def _all_to_all(tensor: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(tensor, size, scatter)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather).contiguous()


class _SeqAllToAll(torch.autograd.Function):
    """All-to-all: split each input along its ``scatter_idx`` over the group, exchange,
    and concatenate what arrives along ``gather_idx`` (Ulysses: sequence shards with all
    heads <-> the whole sequence with a share of the heads). One tensor with int indices,
    or several with one index each (a tuple comes back). The backward exchanges the
    gradients the other way."""

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        scatter_idx: int | list[int],
        gather_idx: int | list[int],
        *input_: torch.Tensor,
    ) -> Any:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        if dist.get_world_size(group) <= 1:
            return input_[0] if len(input_) == 1 else input_
        if len(input_) == 1:
            assert isinstance(scatter_idx, int) and isinstance(gather_idx, int)
            return _all_to_all(input_[0], group, scatter_idx, gather_idx)
        assert isinstance(scatter_idx, list | tuple) and isinstance(gather_idx, list | tuple)
        if not len(scatter_idx) == len(gather_idx) == len(input_):
            raise ValueError(
                f"_SeqAllToAll: {len(input_)} tensors need as many scatter and gather indices "
                f"(got {len(scatter_idx)} and {len(gather_idx)})"
            )
        triples = zip(input_, scatter_idx, gather_idx, strict=True)
        return tuple(_all_to_all(t, group, s, g) for t, s, g in triples)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> Any:
        if dist.get_world_size(ctx.group) <= 1:
            return (None, None, None, *grad_output)
        grads = _SeqAllToAll.apply(ctx.group, ctx.gather_idx, ctx.scatter_idx, *grad_output)
        return (None, None, None, *(grads if len(grad_output) > 1 else (grads,)))
