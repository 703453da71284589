"""The optional capabilities: which adapter declares which, and that the checks are
structural (an engine of another package passes by having the members)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import pytest

from lightrft.engines import capabilities as caps
from lightrft.engines import protocol
from lightrft.engines.base import EngineBase

ALL = {
    caps.PromptLimits, caps.WeightShapes, caps.WeightStreaming, caps.WeightVersion,
    caps.TensorParallel, caps.KeepsSleepState, caps.ComputeDtype, caps.PartialWeightSync,
}  # fmt: skip
DECLARED = {
    "lightrft.engines.hf:HFEngine": {
        caps.PromptLimits, caps.WeightShapes, caps.WeightVersion, caps.KeepsSleepState,
        caps.PartialWeightSync,
    },
    "lightrft.engines.vllm:VLLMEngine": ALL - {caps.PartialWeightSync},
    "lightrft.engines.sglang:SGLangEngine": {
        caps.PromptLimits, caps.WeightVersion, caps.TensorParallel, caps.KeepsSleepState,
        caps.ComputeDtype,
    },
    "lightrft.testing.fake_engine:FakeEngine": {
        caps.PromptLimits, caps.WeightShapes, caps.KeepsSleepState, caps.WeightVersion,
        caps.PartialWeightSync,
    },
}  # fmt: skip


@pytest.mark.parametrize("where", list(DECLARED))
def test_each_adapter_declares_what_it_offers(where: str) -> None:
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert {c for c in ALL if c in cls.__mro__} == DECLARED[where]
    # a declared capability's methods are the adapter's own, not the protocol's stubs
    for capability in DECLARED[where]:
        for member in ("weight_shapes", "update_weights_stream", "finish_partial_weight_update"):
            if hasattr(capability, member):
                assert getattr(cls, member) is not getattr(capability, member), (name, member)


def test_an_engine_passes_by_having_the_members() -> None:
    class Plain:
        vocab_size = 32
        max_model_len = None
        weight_version = 3

        def weight_shapes(self) -> dict[str, tuple[int, ...]]:
            return {"w": (2, 2)}

    engine: Any = Plain()
    assert isinstance(engine, caps.PromptLimits)
    assert isinstance(engine, caps.WeightShapes)
    assert isinstance(engine, caps.WeightVersion)
    assert not isinstance(engine, caps.WeightStreaming)
    assert not isinstance(engine, caps.TensorParallel)
    assert not isinstance(engine, caps.KeepsSleepState)
    assert not isinstance(engine, caps.PartialWeightSync)


def test_a_fake_engine_streams_only_when_asked() -> None:
    from lightrft.testing.fake_engine import FakeEngine

    assert not isinstance(FakeEngine(), caps.WeightStreaming)
    streaming = FakeEngine(weight_stream=True)
    assert isinstance(streaming, caps.WeightStreaming)
    assert isinstance(streaming, protocol.InferenceEngine)
    assert isinstance(streaming.state, protocol.SleepState)


def test_the_stream_signature_is_the_protocols() -> None:
    import inspect

    from lightrft.engines.vllm import VLLMEngine

    ours = inspect.signature(VLLMEngine.update_weights_stream)
    theirs = inspect.signature(caps.WeightStreaming.update_weights_stream)
    assert list(ours.parameters) == list(theirs.parameters)
    assert ours.parameters["named_tensors"].annotation in (
        "Iterable[tuple[str, torch.Tensor]]", Iterable[tuple[str, Any]],
    )  # fmt: skip


# -- EngineBase: the lifecycle the adapters share ------------------------------------------
class _Recorder(EngineBase):
    def __init__(self, fail_release: bool = False) -> None:
        super().__init__(supports_sleep=True)
        self.calls: list[tuple[Any, ...]] = []
        self.fail_release = fail_release

    def _release(self, level: int) -> None:
        self.calls.append(("release", level))
        if self.fail_release:
            raise RuntimeError("the engine could not free its memory")

    def _resume(self, tags: Any, asleep: Any, level: int | None) -> None:
        self.calls.append(("resume", tags, list(asleep), level))

    def _close(self) -> None:
        self.calls.append(("close",))


def test_every_adapter_shares_the_engine_base() -> None:
    for where in DECLARED:
        module, name = where.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), EngineBase), name


def test_the_base_runs_sleep_wake_and_shutdown_around_the_adapters_steps() -> None:
    engine = _Recorder()
    engine.sleep(2)
    assert engine.state.asleep_tags() == ["weights", "kv_cache"]
    engine.wake_up(["weights"])
    engine.wake_up(None)
    assert engine.calls == [
        ("release", 2),
        ("resume", ["weights"], ["weights", "kv_cache"], 2),
        ("resume", None, ["kv_cache"], 2),
    ]
    assert engine.weight_version == 0
    engine._synced()
    assert engine.weight_version == 1 and not engine.state.weights_stale
    engine.shutdown()
    engine.shutdown()
    assert engine.calls[-2:] == [("resume", None, ["kv_cache"], 2), ("close",)]
    assert engine.closed
    with pytest.raises(protocol.EngineError, match=r"shut down \(_Recorder\)"):
        engine.sleep(1)


def test_a_failed_release_leaves_the_engine_awake() -> None:
    engine = _Recorder(fail_release=True)
    with pytest.raises(RuntimeError, match="could not free"):
        engine.sleep(1)
    assert engine.state.asleep_tags() == []
