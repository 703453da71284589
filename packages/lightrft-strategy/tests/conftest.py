"""Every test here is policed by lightrft-testing's ``no_leaks`` fixture: a test that
leaves a process group initialised (every strategy joins one when built: close it), an
environment variable changed or a thread running fails, and the next test starts clean."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _police(no_leaks: None) -> None:
    """Fail the test that leaks (see :mod:`lightrft.testing.leaks`)."""
