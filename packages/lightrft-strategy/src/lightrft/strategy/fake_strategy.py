"""Upstream LightRFT's path ``lightrft.strategy.fake_strategy`` (compatibility only).

The fake ships in lightrft-testing, which depends on this package and registers it as
the ``fake`` backend; this path resolves it through the registry, so it needs
lightrft-testing installed.
"""

from lightrft.strategy import _fake_backend, get_fake_strategy

FakeStrategy = _fake_backend()

__all__ = ["FakeStrategy", "get_fake_strategy"]
