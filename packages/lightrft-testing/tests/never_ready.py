"""A backend that breaks the construction contract, for the conformance suite to catch:
``get_strategy`` hands it back without having joined the job (the bug of issue 9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightrft.testing.fake_strategy import FakeStrategy


class NeverReadyFake(FakeStrategy):
    """FakeStrategy that always defers its setup, whatever the caller asks."""

    def __init__(self, *positional: Any, **overrides: Any) -> None:
        overrides.pop("defer_setup", None)
        super().__init__(*positional, defer_setup=True, **overrides)


def with_never_ready_fake(fn: Callable[..., Any], *args: Any) -> Any:
    """Rank function: run ``fn`` with ``backend='fake'`` resolving to NeverReadyFake."""
    from lightrft.strategy.registry import register_backend

    register_backend("fake", NeverReadyFake)
    return fn(*args)
