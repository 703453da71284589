"""FakeEngine: the documented output rule, sampling validation, the sleep levels, and
the record of weight syncs."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from lightrft.engines import (
    EngineError,
    GenerationOutput,
    InferenceEngine,
    SamplingError,
    SamplingParams,
)
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
    with pytest.raises(SamplingError, match="sampling parameters of type object"):
        engine.generate([[1]], object())
    as_dict = engine.generate([[1]], {"temperature": 1.0, "max_new_tokens": 2})
    assert as_dict == engine.generate([[1]], SamplingParams(temperature=1.0, max_new_tokens=2))
    with pytest.raises(SamplingError, match="non-empty list of token ids"):
        engine.generate([[]])


def _sync(engine: FakeEngine, *buckets: list[tuple[str, torch.Tensor]]) -> None:
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.finish_weight_update()


def test_weight_syncs_are_recorded() -> None:
    engine = FakeEngine(expected_weights=["a", "b"])
    a, b = torch.ones(2, 3), torch.arange(4, dtype=torch.bfloat16)
    _sync(engine, [("a", a)], [("b", b)])
    record = engine.syncs[-1]
    assert record["a"].shape == (2, 3) and record["a"].dtype == torch.float32
    assert record["b"].dtype == torch.bfloat16 and record["b"].sha256 == tensor_digest(b)
    assert engine.bucket_sizes == [1, 1]
    assert engine.weights == record


def test_outputs_after_a_sync_follow_the_documented_rule() -> None:
    engine = FakeEngine(vocab_size=97)
    a, b = torch.ones(2, 3), torch.arange(4, dtype=torch.bfloat16)
    _sync(engine, [("b", b), ("a", a)])
    lines = [f"a\0{a.dtype}\0{tuple(a.shape)}\0{tensor_digest(a)}\n",
             f"b\0{b.dtype}\0{tuple(b.shape)}\0{tensor_digest(b)}\n"]  # fmt: skip
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()  # names in sorted order
    assert engine.weights_digest == digest
    w = [int(digest[8 * i : 8 * i + 8], 16) for i in range(8)]
    assert engine.weights_version == w[0]
    out = engine.generate([[3, 4]], SamplingParams(max_new_tokens=10, n=2, seed=5))
    for k in range(2):
        expected = [
            (7 * 31 + 2 * 17 + 5 * 1009 + k * 7919 + j * 131 + w[j % 8]) % 97 for j in range(10)
        ]
        assert out[k].output_token_ids == expected


def _tokens(outputs: list[GenerationOutput]) -> list[tuple[list[int], list[int]]]:
    """What an engine generated, without ``weight_version`` (which counts syncs)."""
    return [(o.prompt_token_ids, o.output_token_ids) for o in outputs]


def test_generations_depend_on_the_weights_received_and_nothing_else() -> None:
    sampling = SamplingParams(max_new_tokens=8, n=2)
    prompts = [[1, 2], [7]]
    a, b = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.ones(5)

    engine = FakeEngine()
    fresh = engine.generate(prompts, sampling)
    _sync(engine, [("a", a), ("b", b)])
    synced = engine.generate(prompts, sampling)
    assert _tokens(synced) != _tokens(fresh)
    # the same weights again (new tensor objects, other order and buckets): no change
    _sync(engine, [("b", b.clone())], [("a", a.clone())])
    assert _tokens(engine.generate(prompts, sampling)) == _tokens(synced)
    # another engine that received the same weights once generates the same
    other = FakeEngine()
    _sync(other, [("a", a.clone()), ("b", b.clone())])
    assert _tokens(other.generate(prompts, sampling)) == _tokens(synced)
    # one element of one weight changed: other generations; changed back: the same again
    changed_a = a.clone()
    changed_a[2, 1] += 1e-3
    _sync(engine, [("a", changed_a)])
    changed = engine.generate(prompts, sampling)
    pairs = zip(changed, synced, strict=True)
    assert all(x.output_token_ids != y.output_token_ids for x, y in pairs)
    _sync(engine, [("a", a)])
    assert _tokens(engine.generate(prompts, sampling)) == _tokens(synced)
    # the same values in another dtype, or under other names, are other weights
    _sync(engine, [("a", a.double())])
    assert _tokens(engine.generate(prompts, sampling)) != _tokens(synced)
    renamed = FakeEngine()
    _sync(renamed, [("a", b), ("b", a)])
    assert _tokens(renamed.generate(prompts, sampling)) != _tokens(synced)


def test_a_sync_updates_only_the_weights_it_sends() -> None:
    a, b = torch.zeros(3), torch.ones(3)
    both = FakeEngine()
    _sync(both, [("a", a), ("b", b)])
    in_two_syncs = FakeEngine()
    _sync(in_two_syncs, [("a", a)])
    _sync(in_two_syncs, [("b", b)])
    assert in_two_syncs.weights_digest == both.weights_digest
    assert _tokens(in_two_syncs.generate([[1]])) == _tokens(both.generate([[1]]))
    _sync(in_two_syncs)  # a sync that sends nothing changes nothing but the count
    assert _tokens(in_two_syncs.generate([[1]])) == _tokens(both.generate([[1]]))
    assert [o.weight_version for o in in_two_syncs.generate([[1], [2]])] == [3, 3]
    assert both.generate([[1]])[0].weight_version == 1


def test_a_level_2_sleep_discards_the_weights() -> None:
    a, b = torch.zeros(3), torch.ones(3)
    engine = FakeEngine()
    _sync(engine, [("a", a), ("b", b)])
    engine.sleep(1)  # level 1 keeps them
    engine.wake_up()
    assert set(engine.weights) == {"a", "b"}
    engine.sleep(2)
    assert engine.weights == {} and engine.weights_digest == ""
    engine.wake_up()
    _sync(engine, [("a", a)])
    only_a = FakeEngine()
    _sync(only_a, [("a", a)])
    assert _tokens(engine.generate([[1]])) == _tokens(only_a.generate([[1]]))


def test_a_partial_sync_after_a_level_2_sleep_leaves_generation_refused() -> None:
    """A partial sync (the LoRA layers) cannot bring back what the sleep discarded."""
    engine = FakeEngine()
    _sync(engine, [("a", torch.zeros(3)), ("b", torch.ones(3))])
    engine.sleep(2)
    engine.wake_up()
    engine.update_weights([("a", torch.zeros(3))])
    engine.finish_partial_weight_update()
    with pytest.raises(EngineError, match="level-2 sleep"):
        engine.generate([[1]])
    _sync(engine, [("a", torch.zeros(3)), ("b", torch.ones(3))])
    assert len(engine.generate([[1]])) == 1


def test_bad_syncs_name_the_weight_and_keep_nothing() -> None:
    engine = FakeEngine(expected_weights=["a", "b"])
    with pytest.raises(EngineError, match=r"not parameters of the engine's model \(1\): c\b"):
        engine.update_weights([("c", torch.ones(1))])
    engine.update_weights([("a", torch.ones(1))])
    with pytest.raises(EngineError, match="'a' sent twice"):
        engine.update_weights([("a", torch.ones(1))])
    engine.update_weights([("a", torch.ones(1))])
    with pytest.raises(EngineError, match=r"missing \(1\): b\b"):
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
