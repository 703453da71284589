"""pytester for the plugin's own tests; every test policed by ``no_leaks``."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _police(no_leaks: None) -> None:
    """Fail the test that leaks (see :mod:`lightrft.testing.leaks`)."""
