"""lightrft.testing: test helpers for LightRFT training code (see the package README).

``FakeStrategy`` / ``get_fake_strategy`` run the whole strategy interface in one
process; ``FakeEngine`` implements the inference-engine protocol deterministically; the
multi-rank launcher is :mod:`lightrft.testing.launcher`.
Names are imported on first use: importing the launcher does not import torch.
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightrft.testing.fake_engine import FakeEngine, WeightRecord, tensor_digest
    from lightrft.testing.fake_strategy import FakeStrategy, get_fake_strategy

__version__ = _version("lightrft-testing")

__all__ = [
    "FakeEngine",
    "FakeStrategy",
    "WeightRecord",
    "__version__",
    "get_fake_strategy",
    "tensor_digest",
]

_LAZY = {
    "FakeEngine": "fake_engine",
    "WeightRecord": "fake_engine",
    "tensor_digest": "fake_engine",
    "FakeStrategy": "fake_strategy",
    "get_fake_strategy": "fake_strategy",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"lightrft.testing.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
