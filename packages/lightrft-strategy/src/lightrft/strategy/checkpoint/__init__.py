"""The checkpoint layout shared by every backend (see :mod:`.layout`)."""

from lightrft.strategy.checkpoint.layout import (
    CheckpointDir,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    ForeignCheckpointError,
    IncompleteCheckpointError,
)

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ForeignCheckpointError",
    "IncompleteCheckpointError",
]
