"""FakeEngine: the documented output rule, sampling validation, the sleep levels, and
the record of weight syncs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightrft.engines import EngineError, InferenceEngine, SamplingError, SamplingParams
from lightrft.testing import FakeEngine, tensor_digest


def test_it_implements_the_protocol() -> None:
    assert isinstance(FakeEngine(), InferenceEngine)


def test_outputs_follow_the_documented_rule() -> None:
    engine = FakeEngine(vocab_size=50)
    prompt = [3, 4]
    sampling = SamplingParams(max_new_tokens=3, n=2, seed=5)
    outputs = engine.generate([prompt, {"prompt_token_ids": [9]}], sampling)
    assert len(outputs) == 4  # n outputs per prompt, consecutive
    for k in range(2):
        expected = [(7 * 31 + 2 * 17 + 5 * 1009 + k * 7919 + j * 131) % 50 for j in range(3)]
        assert outputs[k].output_token_ids == expected
        assert outputs[k].prompt_token_ids == prompt and outputs[k].finish_reason == "length"
    assert outputs[2].prompt_token_ids == [9]
    assert engine.generate([prompt], sampling)[:1] == outputs[:1]  # deterministic


def test_a_stop_token_ends_a_generation() -> None:
    engine = FakeEngine(vocab_size=50)
    full = engine.generate([[1]], SamplingParams(max_new_tokens=6))[0].output_token_ids
    stopped = engine.generate([[1]], SamplingParams(max_new_tokens=6, stop_token_ids=(full[2],)))
    assert stopped[0].output_token_ids == full[:3] and stopped[0].finish_reason == "stop"


def test_bad_sampling_and_prompts_are_refused() -> None:
    engine = FakeEngine()
    with pytest.raises(SamplingError, match="temperature=-1"):
        engine.generate([[1]], SamplingParams(temperature=-1))
    with pytest.raises(TypeError, match="sampling must be SamplingParams"):
        engine.generate([[1]], {"temperature": 1.0})  # type: ignore[arg-type]
    with pytest.raises(SamplingError, match="non-empty list of token ids"):
        engine.generate([[]])


def test_weight_syncs_are_recorded_and_change_generations() -> None:
    engine = FakeEngine(expected_weights=["a", "b"])
    before = engine.generate([[1, 2]])
    a, b = torch.ones(2, 3), torch.arange(4, dtype=torch.bfloat16)
    engine.update_weights([("a", a)])
    engine.update_weights([("b", b)])
    engine.finish_weight_update()
    record = engine.syncs[-1]
    assert record["a"].shape == (2, 3) and record["a"].dtype == torch.float32
    assert record["b"].dtype == torch.bfloat16 and record["b"].sha256 == tensor_digest(b)
    assert engine.bucket_sizes == [1, 1]
    assert engine.generate([[1, 2]]) != before


def test_bad_syncs_name_the_weight_and_keep_nothing() -> None:
    engine = FakeEngine(expected_weights=["a", "b"])
    with pytest.raises(EngineError, match="no parameter 'c'"):
        engine.update_weights([("c", torch.ones(1))])
    engine.update_weights([("a", torch.ones(1))])
    with pytest.raises(EngineError, match="'a' sent twice"):
        engine.update_weights([("a", torch.ones(1))])
    engine.update_weights([("a", torch.ones(1))])
    with pytest.raises(EngineError, match=r"incomplete: missing \['b'\]"):
        engine.finish_weight_update()
    assert engine.syncs == []


def test_sleep_levels_are_enforced() -> None:
    engine = FakeEngine()
    engine.sleep(2)
    with pytest.raises(EngineError, match="asleep"):
        engine.generate([[1]])
    engine.wake_up(["weights"])
    engine.update_weights([("w", torch.ones(1))])
    engine.finish_weight_update()
    engine.wake_up(["kv_cache"])
    assert len(engine.generate([[1]])) == 1
    engine.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        engine.generate([[1]])
    with pytest.raises(EngineError, match="does not support sleep"):
        FakeEngine(supports_sleep=False).sleep(1)


def test_importing_the_launcher_does_not_import_torch() -> None:
    code = "import sys, lightrft.testing.launcher; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
