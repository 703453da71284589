"""The PyTorch FSDP2 (``fully_shard``) backend."""

from lightrft.strategy.fsdp2.strategy import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
