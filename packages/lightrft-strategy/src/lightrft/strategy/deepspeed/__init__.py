"""The DeepSpeed backend (extra ``deepspeed``): ``DeepspeedStrategy``.

``ds_config`` (the config builder) imports without DeepSpeed; the strategy needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightrft.strategy.deepspeed.strategy import DeepspeedStrategy

__all__ = ["DeepspeedStrategy"]


def __getattr__(name: str) -> Any:
    if name == "DeepspeedStrategy":
        try:
            from lightrft.strategy.deepspeed.strategy import DeepspeedStrategy
        except ModuleNotFoundError as exc:
            if exc.name != "deepspeed":
                raise
            raise ImportError(
                "DeepspeedStrategy needs DeepSpeed; install it with: "
                "pip install 'lightrft-strategy[deepspeed]'"
            ) from exc
        return DeepspeedStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
