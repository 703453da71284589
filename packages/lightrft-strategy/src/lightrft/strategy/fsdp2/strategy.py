"""`FSDP2Strategy`: StrategyBase over ``torch.distributed.fsdp.fully_shard``."""

from __future__ import annotations

from typing import Any

from lightrft.strategy.base import StrategyBase
from lightrft.strategy.construction import BASE_PARAMETERS
from lightrft.strategy.fsdp2.backend import FSDP2Backend

__all__ = ["FSDP2Strategy", "FSDPV2Strategy"]


class FSDP2Strategy(StrategyBase):
    """A strategy whose backend is :class:`~lightrft.strategy.fsdp2.backend.FSDP2Backend`:
    every model sharded with FSDP2 over a 1-D mesh (or the HSDP 2-D mesh when
    ``fsdp_shard_size`` is set), per transformer block and at the root.

    Mixed precision follows ``precision``/``bf16`` (gradients reduced in fp32);
    ``fsdp_cpu_offload`` offloads parameters to CPU. Checkpoints go through
    ``torch.distributed.checkpoint``, so a checkpoint saved at one world size loads
    at another.
    """

    backend_name = "fsdp2"
    backend_class = FSDP2Backend
    backend: FSDP2Backend
    #: ``FSDPV2Strategy(seed, max_norm, micro_train_batch_size, train_batch_size, bf16,
    #: args)`` as upstream.
    upstream_parameters = (*BASE_PARAMETERS[:-1], "bf16", "args")

    @property
    def mesh(self) -> Any:
        """The device mesh models are sharded over (None before setup)."""
        return self.backend.mesh


#: Upstream's name for this backend (``lightrft.strategy.fsdp.fsdpv2.FSDPV2Strategy``).
FSDPV2Strategy = FSDP2Strategy
