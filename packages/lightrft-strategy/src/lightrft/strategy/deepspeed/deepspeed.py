"""Upstream LightRFT's path ``lightrft.strategy.deepspeed.deepspeed`` (compatibility only;
the backend is :mod:`lightrft.strategy.deepspeed.strategy`)."""

from lightrft.strategy.deepspeed.strategy import DeepspeedStrategy

__all__ = ["DeepspeedStrategy"]
