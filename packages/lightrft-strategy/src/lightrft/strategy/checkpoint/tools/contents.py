"""What a checkpoint holds once read in one process: full tensors by parameter name.

Filled by :mod:`~lightrft.strategy.checkpoint.tools.offline` (FSDP2's files) and
:mod:`~lightrft.strategy.checkpoint.tools.deepspeed_files` (DeepSpeed's), read by the export
and conversion commands; a module of its own so that neither reader imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightrft.strategy.checkpoint.layout import CheckpointInfo


@dataclass
class OptimizerContents:
    """An optimizer's full state keyed by parameter name (not by torch's integer ids)."""

    state: dict[str, dict[str, torch.Tensor]]
    param_groups: list[dict[str, Any]]


@dataclass
class CheckpointContents:
    info: CheckpointInfo
    weights: dict[str, torch.Tensor]
    optimizer: OptimizerContents | None = None  # None: not read, or it never stepped
