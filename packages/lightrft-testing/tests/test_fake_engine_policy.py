"""FakeEngine with a policy: completions sampled from a causal LM (checked against
transformers' own ``generate`` and logits), weights replaced by every sync, and built
from a spec that names a saved model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.engines import EngineError, SamplingParams, WeightMismatchError, build_engine
from lightrft.testing import FakeEngine
from lightrft.testing.models import (
    ENGINE_QWEN2,
    greedy_reference,
    save_tiny_qwen2,
    tiny_hf_causal_lm,
    tiny_qwen2_config,
)

PROMPTS = [[3, 9, 27], [5, 1], [60, 2, 8, 4]]
VOCAB = int(tiny_qwen2_config().vocab_size)


def _model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return tiny_hf_causal_lm(**ENGINE_QWEN2).eval()


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.output_token_ids for o in outputs]


def test_greedy_equals_transformers_generate_and_logprobs_its_logits() -> None:
    model = _model()
    engine = FakeEngine(vocab_size=model.config.vocab_size, policy=copy.deepcopy(model))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, logprobs=True))
    assert _tokens(outs) == greedy_reference(model, PROMPTS, 6)
    sequence = torch.tensor([PROMPTS[0] + outs[0].output_token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(sequence).logits[0].float(), -1)
    start = len(PROMPTS[0]) - 1  # the logits at position i predict token i + 1
    expected = [float(logp[start + j, t]) for j, t in enumerate(outs[0].output_token_ids)]
    assert outs[0].logprobs == pytest.approx(expected, abs=1e-5)
    # top-k 1, or a top-p that keeps only the likeliest token, is greedy decoding too
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, **narrow)
        assert _tokens(engine.generate(PROMPTS, sampled)) == _tokens(outs)


def test_seeded_sampling_is_reproducible_per_prompt_with_n_samples_in_order() -> None:
    engine = FakeEngine(vocab_size=VOCAB, policy=_model())
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=7)
    outs = engine.generate(PROMPTS, sampling)
    assert [o.prompt_token_ids for o in outs] == [p for p in PROMPTS for _ in range(4)]
    assert _tokens(outs) == _tokens(engine.generate(PROMPTS, sampling))
    assert len({tuple(t) for t in _tokens(outs[:4])}) > 1  # the samples differ
    # request i is seeded seed + i, as the vLLM and SGLang adapters do: a prompt repeated
    # in one call gets other samples, and moved to position 0 it gets position 0's seed
    twice = engine.generate([PROMPTS[0], PROMPTS[0]], sampling)
    assert _tokens(twice[:4]) == _tokens(outs[:4]) != _tokens(twice[4:])
    moved = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=8)
    assert _tokens(engine.generate(PROMPTS[1:2], moved)) == _tokens(outs[4:8])
    other_seed = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=9)
    assert _tokens(engine.generate(PROMPTS, other_seed)) != _tokens(outs)
    # no seed: drawn from torch's generator, so reproducible under torch.manual_seed
    unseeded = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    torch.manual_seed(0)
    first = _tokens(engine.generate(PROMPTS, unseeded))
    torch.manual_seed(0)
    assert _tokens(engine.generate(PROMPTS, unseeded)) == first


def test_a_stop_token_ends_a_completion() -> None:
    model = _model()
    engine = FakeEngine(vocab_size=model.config.vocab_size, policy=model)
    (greedy,) = greedy_reference(model, PROMPTS[:1], 6)
    out = engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(greedy[2],))
    )[0]
    stop = greedy.index(greedy[2])
    assert out.output_token_ids == greedy[: stop + 1] and out.finish_reason == "stop"


def test_a_sync_replaces_the_weights_and_a_bad_one_keeps_them() -> None:
    engine = FakeEngine(vocab_size=VOCAB, policy=_model(0))
    trained = _model(1)  # other weights, same names and shapes
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    before = _tokens(engine.generate(PROMPTS, greedy))
    named = list(trained.named_parameters())
    engine.update_weights((n, p.detach()) for n, p in named[:5])
    engine.update_weights((n, p.detach()) for n, p in named[5:])
    engine.finish_weight_update()
    after = engine.generate(PROMPTS, greedy)
    assert _tokens(after) == greedy_reference(trained, PROMPTS, 6) != before
    assert {o.weight_version for o in after} == {1}
    name, param = named[0]
    with pytest.raises(WeightMismatchError, match=rf"{name} sent \[3\] but the engine has"):
        engine.update_weights([(name, torch.zeros(3))])
    with pytest.raises(
        WeightMismatchError, match=r"not parameters of the engine's model \(1\): x\b"
    ):
        engine.update_weights([("x", torch.zeros(1))])
    engine.update_weights([(name, param.detach() * 0)])
    with pytest.raises(WeightMismatchError, match="missing"):
        engine.finish_weight_update()
    assert _tokens(engine.generate(PROMPTS, greedy)) == _tokens(after)  # kept
    assert engine.weight_version == 1


def test_built_from_a_spec_naming_a_model_it_samples_from_that_model(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", seed=4)
    engine = build_engine({"engine_type": "fake", "pretrain": str(path)})
    model = tiny_hf_causal_lm(**ENGINE_QWEN2)
    model.load_state_dict(engine.policy.state_dict())
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    assert _tokens(engine.generate(PROMPTS, greedy)) == greedy_reference(model, PROMPTS, 5)
    assert engine.vocab_size == VOCAB
    plain = build_engine(
        {
            "engine_type": "fake",
            "pretrain": str(path),
            "engine_options": {"sample_from_model": False},
        }
    )
    assert plain.policy is None and plain.vocab_size == VOCAB
    (tmp_path / "other").mkdir()  # a folder that holds no causal LM
    (tmp_path / "other" / "config.json").write_text(
        '{"model_type": "not-a-model", "vocab_size": 9}'
    )
    with pytest.raises(EngineError, match="sample_from_model=False"):
        build_engine({"engine_type": "fake", "pretrain": str(tmp_path / "other")})
