"""Shared fixtures: a tiny random Qwen2 saved as a Hugging Face directory (no download);
every test policed by lightrft-testing's ``no_leaks`` (no process group, environment
variable or thread left behind)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lightrft.testing's engine-ready tiny Qwen2 (seed 0), saved with save_pretrained."""
    from lightrft.testing.models import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(autouse=True)
def _police(no_leaks: None) -> None:
    """Fail the test that leaks (see :mod:`lightrft.testing.leaks`)."""
