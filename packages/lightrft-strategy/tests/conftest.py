"""Every test here is policed by lightrft-testing's ``no_leaks`` fixture: a test that
leaves a process group initialised (every strategy joins one when built: close it), an
environment variable changed or a thread running fails, and the next test starts clean."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from lightrft.strategy import StrategyBase

if TYPE_CHECKING:
    from lightrft.strategy.fsdp2 import FSDP2Strategy


@pytest.fixture(autouse=True)
def _police(no_leaks: None) -> None:
    """Fail the test that leaks (see :mod:`lightrft.testing.leaks`)."""


@pytest.fixture
def fsdp2() -> Iterator[StrategyBase]:
    """A ready FSDP2 strategy in this process (a world of one), closed afterwards."""
    from lightrft.strategy import get_strategy

    from . import workers

    strategy = get_strategy(workers.config())  # ready when built
    yield strategy
    strategy.close()


@pytest.fixture
def single() -> Iterator[Callable[..., FSDP2Strategy]]:
    """Build FSDP2 strategies in this process (a world of one); each is closed after the
    test (with its engine and process group). The engine-link tests' strategies."""
    from lightrft.strategy.fsdp2 import FSDP2Strategy

    made: list[FSDP2Strategy] = []

    def make(**fields: object) -> FSDP2Strategy:
        made.append(FSDP2Strategy(device="cpu", **fields))
        return made[-1]

    yield make
    for strategy in reversed(made):
        strategy.close()
