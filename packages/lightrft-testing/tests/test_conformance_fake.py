"""The conformance suite against FakeStrategy (one rank, one process per check), and
against a backend that breaks its contract, to show the suite catches it."""

from __future__ import annotations

from typing import Any

import pytest

from lightrft.testing.conformance import StrategyConformance

from .never_ready import with_never_ready_fake


class TestFakeStrategyConformance(StrategyConformance):
    backend = {"backend": "fake"}  # noqa: RUF012 - the suite's class attribute
    world_size = 1


class _NeverReadyConformance(StrategyConformance):
    """The suite, run on NeverReadyFake (each rank function is wrapped to select it)."""

    backend = {"backend": "fake"}  # noqa: RUF012 - the suite's class attribute
    world_size = 1

    def _run(self, fn: Any, *args: Any, world_size: int | None = None, **kw: Any) -> list[Any]:
        return super()._run(with_never_ready_fake, fn, *args, world_size=world_size, **kw)


def test_a_backend_that_is_not_ready_when_built_fails_the_suite() -> None:
    suite = _NeverReadyConformance()
    with pytest.raises(AssertionError, match="not set up"):
        suite.test_get_strategy_returns_a_ready_strategy()
    # and the first training call says what is missing, instead of training alone
    with pytest.raises(Exception, match=r"setup_distributed\(\)"):
        suite.test_training_matches_the_unsharded_reference()
