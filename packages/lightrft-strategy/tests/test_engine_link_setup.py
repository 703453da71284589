"""Setting up the strategy's rollout engine (``EngineLink.attach``/``build`` and
:mod:`~lightrft.strategy.engine_link.common`): what counts as an engine, the calls
that need one, and upstream's form that builds the engine from its arguments, against
lightrft-testing's FakeEngine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightrft.engines import SamplingParams
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing import FakeEngine

from . import workers


def test_engine_calls_need_an_engine(single: Callable[..., FSDP2Strategy]) -> None:
    strategy = single()
    with pytest.raises(RuntimeError, match=r"setup_inference_engine\(\.\.\.\) first"):
        strategy.gather_and_generate([[1]])
    with pytest.raises(TypeError, match=r"object is not an inference engine: it lacks generate"):
        strategy.setup_inference_engine(object())


def test_upstream_setup_builds_the_engine_from_args_syncs_the_actor_and_sleeps(
    single: Callable[..., FSDP2Strategy],
) -> None:
    import argparse

    strategy = single(enable_engine_sleep=True)
    model = workers.TinyRegressor()
    names = [n for n, _ in model.named_parameters()]
    args = argparse.Namespace(engine_type="fake", engine_tp_size=1, enable_engine_sleep=True)
    engine = strategy.setup_inference_engine(
        args, engine_type="fake", actor=model, expected_weights=names
    )
    assert type(engine).__name__ == "FakeEngine" and strategy.inference_engine is engine
    assert len(engine.syncs) == 1 and set(engine.syncs[0]) == set(names)  # actor synced
    assert engine.state.asleep  # then put to sleep, upstream's order
    # upstream's gather_and_generate: wakes, generates, sleeps again (sleep_engine=True)
    outs = strategy.gather_and_generate(
        SamplingParams(max_new_tokens=3), all_prompt_token_ids=[[1, 2]]
    )
    assert [o.prompt_token_ids for o in outs] == [[1, 2]] and engine.state.asleep
    outs = strategy.gather_and_generate(SamplingParams(max_new_tokens=3), [[4]], sleep_engine=False)
    assert [o.prompt_token_ids for o in outs] == [[4]] and not engine.state.asleep
    assert outs[0].weight_version == 1


def test_is_engine_tells_engines_from_models() -> None:
    from lightrft.strategy import is_engine

    assert is_engine(FakeEngine())
    assert not is_engine(workers.TinyRegressor()) and not is_engine(None)
