"""lightrft.testing: test helpers for LightRFT training code (see the package README).

``FakeEngine`` implements the inference-engine protocol deterministically; the
multi-rank launcher is :mod:`lightrft.testing.launcher`. ``FakeStrategy`` is to come.
Names are imported on first use: importing the launcher does not import torch.
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightrft.testing.fake_engine import FakeEngine, WeightRecord, tensor_digest

__version__ = _version("lightrft-testing")

__all__ = ["FakeEngine", "WeightRecord", "__version__", "tensor_digest"]

_LAZY = {"FakeEngine", "WeightRecord", "tensor_digest"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from lightrft.testing import fake_engine

        return getattr(fake_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
