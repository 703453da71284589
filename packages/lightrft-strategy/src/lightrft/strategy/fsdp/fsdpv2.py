"""Upstream LightRFT's path ``lightrft.strategy.fsdp.fsdpv2`` (compatibility only; the
backend is :mod:`lightrft.strategy.fsdp2.strategy`)."""

from lightrft.strategy.fsdp2.strategy import FSDPV2Strategy

__all__ = ["FSDPV2Strategy"]
