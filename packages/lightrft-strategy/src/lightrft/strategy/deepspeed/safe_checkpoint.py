"""DeepSpeed's engine checkpoint files, read without arbitrary unpickling.

DeepSpeed's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``,
which runs any code a crafted file carries. :class:`SafeTorchCheckpointEngine` reads
the same files with ``weights_only=True``, allowing only the few DeepSpeed classes its
own checkpoints hold (the loss scaler, the ZeRO stage enum, fragment addresses).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lightrft.strategy.checkpoint.layout import CheckpointError


def _allowed_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class SafeTorchCheckpointEngine(TorchCheckpointEngine):  # type: ignore[misc]
    """``TorchCheckpointEngine`` whose ``load`` never unpickles arbitrary objects."""

    def load(self, path: str, map_location: Any = None) -> Any:
        try:
            with torch.serialization.safe_globals(_allowed_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path} holds objects a DeepSpeed checkpoint written by LightRFT does not "
                f"hold, and it is not loaded ({' '.join(str(exc).split())[:300]}). Load only "
                "checkpoints from a trusted source"
            ) from exc


def install(engine: Any) -> None:
    """Make ``engine`` read its checkpoints through :class:`SafeTorchCheckpointEngine`."""
    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is TorchCheckpointEngine:
        safe = SafeTorchCheckpointEngine.__new__(SafeTorchCheckpointEngine)
        safe.__dict__.update(current.__dict__)
        engine.checkpoint_engine = safe
