"""The conformance suite against FakeStrategy (one rank, one process per check)."""

from __future__ import annotations

from lightrft.testing.conformance import StrategyConformance


class TestFakeStrategyConformance(StrategyConformance):
    backend = {"backend": "fake"}  # noqa: RUF012 - the suite's class attribute
    world_size = 1
