"""Upstream LightRFT's path ``lightrft.strategy.fsdp`` (compatibility only; the backend
is :mod:`lightrft.strategy.fsdp2`)."""
