"""The PyTorch FSDP2 (``fully_shard``) backend; ``FSDPV2Strategy`` is upstream's name."""

from lightrft.strategy.fsdp2.strategy import FSDP2Strategy, FSDPV2Strategy

__all__ = ["FSDP2Strategy", "FSDPV2Strategy"]
