"""Every strategy joins a process group when built (a world of one in this process);
a test that does not close its strategy must not hand that group to the next test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
