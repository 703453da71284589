"""The pytest plugin, as a downstream project sees it (pytester runs a fresh pytest)."""

from __future__ import annotations

import subprocess
import sys

import pytest

DOWNSTREAM_TEST = """
import pytest
import torch

from lightrft.engines import SamplingParams


def test_fixtures_work_together(fake_strategy, fake_engine, tiny_causal_lm, checkpoint_dir):
    assert fake_strategy.config.backend == "fake" and fake_strategy.accumulated_gradient == 2
    (model, optim, sched), *_ = fake_strategy.prepare_models_and_optimizers(
        tiny_causal_lm, None, None, None, max_steps=4
    )
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        fake_strategy.backward(model.loss(ids), model, optim)
        fake_strategy.optimizer_step(optim, model, sched)
    assert fake_strategy.step_state(model).global_steps == 1
    fake_strategy.save_ckpt(model, checkpoint_dir)
    assert (checkpoint_dir / "latest").read_text().strip() == "global_step1"
    fake_strategy.setup_inference_engine(fake_engine)
    fake_strategy.update_engine_weights(model)
    out = fake_strategy.gather_and_generate([[1, 2]], SamplingParams(max_new_tokens=3))
    assert len(out[0].output_token_ids) == 3


def _rank(x):
    import torch.distributed as dist
    return dist.get_rank() * x


@pytest.mark.distributed
def test_run_on_ranks(run_on_ranks):
    assert run_on_ranks(_rank, 2, 5) == [0, 5]


@pytest.mark.gpu
def test_marked_gpu():
    pass
"""


def test_a_downstream_suite_uses_the_fixtures_and_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_downstream=DOWNSTREAM_TEST)
    result = pytester.runpytest_subprocess("--strict-markers", "-m", "not gpu", "-q")
    result.assert_outcomes(passed=2, deselected=1)


def test_the_plugin_is_registered_and_imports_nothing_heavy() -> None:
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="pytest11") if ep.name == "lightrft"]
    assert ep.value == "lightrft.testing.plugin"
    code = (
        "import sys, lightrft.testing.plugin\n"
        "print(sorted({'torch', 'lightrft.strategy', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
