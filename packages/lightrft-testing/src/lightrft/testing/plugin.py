"""The pytest plugin (entry point ``pytest11: lightrft``), loaded wherever
lightrft-testing is installed.

It registers the markers ``gpu`` and ``distributed`` and these fixtures; nothing heavy
is imported until a fixture is used:

* ``strategy_config``: a small CPU :class:`~lightrft.config.StrategyConfig` (fake
  backend, seed 0, fp32, micro-batch 2, global batch 4);
* ``fake_strategy``: a set-up :class:`~lightrft.testing.FakeStrategy` on that config;
* ``fake_engine``: a :class:`~lightrft.testing.FakeEngine`;
* ``tiny_causal_lm``: a :class:`~lightrft.testing.models.TinyCausalLM` (seeded);
* ``checkpoint_dir``: an empty directory for ``save_ckpt``;
* ``run_on_ranks``: ``run_on_ranks(fn, world_size, *args, **kwargs)`` runs ``fn`` on
  that many real gloo ranks (free port, timeout) and returns every rank's result
  (:func:`lightrft.testing.launcher.run_distributed`);
* ``no_leaks``: fails the test that leaves a process group initialised, an environment
  variable changed or a thread running, and cleans up after it
  (:mod:`lightrft.testing.leaks`). Use it in every test of a suite with an autouse
  fixture in its ``conftest.py``::

      @pytest.fixture(autouse=True)
      def _police(no_leaks: None) -> None: ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.testing.fake_engine import FakeEngine
    from lightrft.testing.fake_strategy import FakeStrategy
    from lightrft.testing.models import TinyCausalLM


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run where one exists)")
    config.addinivalue_line(
        "markers", "distributed: starts several real processes joined in a process group"
    )


@pytest.fixture
def strategy_config() -> StrategyConfig:
    from lightrft.config import StrategyConfig

    return StrategyConfig(
        backend="fake", device="cpu", seed=0, precision="fp32",
        micro_train_batch_size=2, train_batch_size=4,
    )  # fmt: skip


@pytest.fixture
def fake_strategy(strategy_config: StrategyConfig) -> Iterator[FakeStrategy]:
    from lightrft.testing.fake_strategy import FakeStrategy

    strategy = FakeStrategy(args=strategy_config)
    yield strategy
    strategy.close()


@pytest.fixture
def fake_engine() -> FakeEngine:
    from lightrft.testing.fake_engine import FakeEngine

    return FakeEngine()


@pytest.fixture
def tiny_causal_lm() -> TinyCausalLM:
    import torch

    from lightrft.testing.models import TinyCausalLM

    torch.manual_seed(0)
    return TinyCausalLM()


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def no_leaks() -> Iterator[None]:
    from lightrft.testing import leaks

    before = leaks.snapshot()
    yield
    found = leaks.find(before)
    leaks.clean_up(before)
    if found:
        pytest.fail("the test left behind:\n  " + "\n  ".join(found), pytrace=False)


@pytest.fixture
def run_on_ranks() -> Callable[..., list[Any]]:
    from lightrft.testing.launcher import run_distributed

    return run_distributed
