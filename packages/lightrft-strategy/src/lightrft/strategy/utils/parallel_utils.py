"""Upstream LightRFT's path ``lightrft.strategy.utils.parallel_utils`` (compatibility
only; the names live in :mod:`lightrft.strategy.sequence_parallel`)."""

from lightrft.strategy.sequence_parallel import (
    SPDataProcessor,
    _gather,
    _GatherForwardSplitBackward,
    _SeqAllToAll,
    _split,
    gather_forward_split_backward_and_unpad,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    set_sequence_parallel_group,
    sp_slice_and_pad_input,
)

__all__ = [
    "SPDataProcessor",
    "_GatherForwardSplitBackward",
    "_SeqAllToAll",
    "_gather",
    "_split",
    "gather_forward_split_backward_and_unpad",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "set_sequence_parallel_group",
    "sp_slice_and_pad_input",
]
