"""Sleep and wake of the rollout engine (:mod:`lightrft.strategy.engine_link.sleep`):
the configured levels, the wake-ups around syncs and generation, interrupted calls,
engines that keep no SleepState or cannot sleep, against lightrft-testing's FakeEngine
(which enforces the sleep levels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightrft.engines import EngineError, PromptError, SamplingParams
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing import FakeEngine

from . import workers


def test_sleep_levels_follow_config_and_stale_weights_are_refused(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single(enable_engine_sleep=True, engine_sleep_level=2)
    model = workers.TinyRegressor()
    engine = strategy.setup_inference_engine(FakeEngine())
    assert strategy.maybe_sleep_inference_engine() is True
    # generating wakes the engine, but a level-2 sleep discarded the weights
    with pytest.raises(EngineError, match="stale weights"):
        strategy.gather_and_generate([[1]])
    assert not engine.state.asleep
    strategy.maybe_sleep_inference_engine()
    woken: list[Any] = []
    wake_up = engine.wake_up
    engine.wake_up = lambda tags=None: (woken.append(tags), wake_up(tags))  # type: ignore[method-assign]
    # the sync wakes the weights, loads them, then wakes the KV cache (upstream leaves
    # the engine awake after update_engine_weights)
    strategy.update_engine_weights(model)
    assert woken == [["weights"], ["kv_cache"]] and not engine.state.asleep
    assert engine.state.weights_stale is False and len(engine.syncs) == 1
    assert len(strategy.gather_and_generate([[1]])) == 1
    assert woken == [["weights"], ["kv_cache"]]  # awake: nothing more to wake
    # our form sleeps after generating only when asked; level 1 keeps the weights
    strategy.config.engine_sleep_level = 1
    assert len(strategy.gather_and_generate([[1]], sleep_engine=True)) == 1
    assert engine.state.asleep and engine.state.level == 1
    assert len(strategy.gather_and_generate([[2]])) == 1  # woken (both tags at once)
    assert woken[-1] is None and not engine.state.asleep and len(engine.syncs) == 1


def test_an_interrupted_call_leaves_the_engine_asleep_not_half_awake(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single(enable_engine_sleep=True, engine_sleep_level=1)
    model = workers.TinyRegressor()
    names = [n for n, _ in model.named_parameters()]
    engine = strategy.setup_inference_engine(FakeEngine(vocab_size=16, expected_weights=names))
    strategy.update_engine_weights(model)
    assert strategy.maybe_sleep_inference_engine() and len(engine.syncs) == 1
    # FakeEngine finds a missing name at the end of the sync: the weights were woken for
    # it, the KV cache not yet
    with pytest.raises(EngineError, match="missing"):
        strategy.update_engine_weights(model, name_map=lambda n: None if "head" in n else n)
    assert engine.state.weights_awake and not engine.state.kv_awake
    assert strategy.maybe_sleep_inference_engine() is True  # woken whole, then asleep
    assert not engine.state.weights_awake and not engine.state.kv_awake
    # a refused prompt: the engine goes back to sleep all the same
    with pytest.raises(PromptError):
        strategy.gather_and_generate([[99]], sleep_engine=True)
    assert not engine.state.weights_awake and not engine.state.kv_awake
    assert len(engine.syncs) == 1


class _EngineWithoutState:
    """An engine that keeps no SleepState (the protocol makes ``state`` optional): it
    refuses, as vLLM would misbehave, to generate or load weights while asleep, or to
    sleep twice."""

    supports_sleep = True
    generate_on_every_rank = True
    vocab_size = 16

    def __init__(self) -> None:
        self.inner = FakeEngine(vocab_size=16)
        self.asleep = False
        self.calls: list[str] = []

    def _awake(self, call: str) -> None:
        self.calls.append(call)
        if self.asleep:
            raise EngineError(f"{call} while asleep")

    def generate(self, prompts: Any, sampling: Any = None) -> Any:
        self._awake("generate")
        return self.inner.generate(prompts, sampling)

    def update_weights(self, named_tensors: Any) -> None:
        self._awake("update_weights")
        self.inner.update_weights(named_tensors)

    def finish_weight_update(self) -> None:
        self._awake("finish_weight_update")
        self.inner.finish_weight_update()

    def sleep(self, level: int = 1) -> None:
        self._awake("sleep")
        self.asleep = True

    def wake_up(self, tags: Any = None) -> None:
        self.calls.append(f"wake_up {tags}")
        self.asleep = False

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_an_engine_without_sleep_state_is_woken_of_what_the_strategy_slept(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single(enable_engine_sleep=True, engine_sleep_level=1)
    model = workers.TinyRegressor()
    engine = _EngineWithoutState()
    strategy.setup_inference_engine(engine)
    for prompt in ([1], [2]):  # generate, then sleep; the next call wakes it first
        assert len(strategy.gather_and_generate([prompt], sleep_engine=True)) == 1
        assert engine.asleep
    strategy.update_engine_weights(model)  # wakes it (weights, sync, KV cache)
    assert not engine.asleep and len(engine.inner.syncs) == 1
    assert engine.calls == [
        "generate", "sleep", "wake_up None", "generate", "sleep",
        "wake_up ['weights']", "update_weights", "finish_weight_update", "wake_up ['kv_cache']",
    ]  # fmt: skip
    # one the strategy did not put to sleep is left alone by the engine calls' own
    # wake-ups; the explicit call wakes it as asked
    engine.asleep = True
    with pytest.raises(EngineError, match="generate while asleep"):
        strategy.gather_and_generate([[3]])
    strategy.wakeup_inference_engine()
    assert not engine.asleep and len(strategy.gather_and_generate([[3]])) == 1


def test_an_explicit_wake_up_wakes_exactly_the_tags_named(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single(enable_engine_sleep=True, engine_sleep_level=2)
    engine = strategy.setup_inference_engine(FakeEngine())
    strategy.maybe_sleep_inference_engine()
    with pytest.raises(EngineError, match=r"wake_up tags \['kvcache'\] are invalid"):
        strategy.wakeup_inference_engine(["weights", "kvcache"])  # a typo is refused
    assert not engine.state.weights_awake and not engine.state.kv_awake
    strategy.wakeup_inference_engine(["weights", "weights"])
    assert engine.state.weights_awake and not engine.state.kv_awake


def test_sleep_calls_do_nothing_when_sleep_is_disabled(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    engine = strategy.setup_inference_engine(FakeEngine())
    assert strategy.maybe_sleep_inference_engine() is False
    strategy.wakeup_inference_engine()
    assert engine.state.asleep is False


def test_an_engine_that_cannot_sleep_is_skipped_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single(enable_engine_sleep=True)
    engine = strategy.setup_inference_engine(FakeEngine(supports_sleep=False))
    with caplog.at_level("WARNING", logger="lightrft.strategy.engine_link"):
        assert strategy.maybe_sleep_inference_engine() is False
        assert strategy.maybe_sleep_inference_engine() is False
        outs = strategy.gather_and_generate(SamplingParams(max_new_tokens=1), [[1]])
    assert len(outs) == 1 and not engine.state.asleep
    lines = [r for r in caplog.records if "cannot sleep" in r.getMessage()]
    assert len(lines) == 1 and "FakeEngine" in lines[0].getMessage()
