"""The Hugging Face engine against transformers' own generate, on a tiny random Qwen2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.engines import (
    EngineError,
    PromptError,
    SamplingParams,
    WeightMismatchError,
    build_engine,
)
from lightrft.engines.hf import HFEngine
from lightrft.testing.models import greedy_reference

PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7, 7, 7]]  # uneven: left padding is exercised


def _engine(path: Path, **changes: Any) -> HFEngine:
    args = {"engine_type": "hf", "pretrain": str(path), "bf16": False, "device": "cpu"}
    args.update(changes)
    engine = build_engine(args)
    assert isinstance(engine, HFEngine)
    return engine


def _sync(engine: HFEngine, named: list[tuple[str, torch.Tensor]]) -> None:
    for start in range(0, len(named), 5):  # in buckets, as the strategy sends them
        engine.update_weights(named[start : start + 5])
    engine.finish_weight_update()


def test_greedy_equals_transformers_generate_prompt_by_prompt(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    expected = greedy_reference(engine.model, PROMPTS, 8)
    assert [o.output_token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert {o.finish_reason for o in outs} == {"length"}
    assert {o.weight_version for o in outs} == {0}
    assert len({tuple(e) for e in expected}) > 1  # the model does not ignore its prompt


@pytest.mark.parametrize(("temperature", "top_k"), [(0.8, -1), (0.7, 5)])
def test_logprobs_are_those_of_the_distribution_sampled_from(
    tiny_model_dir: Path, temperature: float, top_k: int
) -> None:
    """log_softmax(logits / temperature), over the top-k tokens (renormalised) with top-k:
    what a trainer computes for the same token."""
    engine = _engine(tiny_model_dir)
    params = SamplingParams(
        max_new_tokens=6, temperature=temperature, top_k=top_k, seed=1, logprobs=True
    )
    for out in engine.generate(PROMPTS, params):
        ids = torch.tensor([out.prompt_token_ids + out.output_token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0] / temperature
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        logits = logits.log_softmax(-1)
        start = len(out.prompt_token_ids)
        want = [float(logits[start - 1 + j, t]) for j, t in enumerate(out.output_token_ids)]
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_token_ids)
        torch.testing.assert_close(out.logprobs, want, rtol=1e-4, atol=1e-4)


def test_seeded_sampling_repeats_and_n_samples_come_in_prompt_order(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=7)
    first = engine.generate(PROMPTS, params)
    assert first == engine.generate(PROMPTS, params)  # same seed: same samples
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=4, seed=8))
    assert [o.output_token_ids for o in other] != [o.output_token_ids for o in first]
    assert [o.prompt_token_ids for o in first] == [p for p in PROMPTS for _ in range(4)]
    samples = [tuple(o.output_token_ids) for o in first[:4]]
    assert len(set(samples)) > 1, "n=4 returned the same sample four times"


def test_stop_token_ids_end_the_output_with_the_stop_token(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    full = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0))[0]
    stop = full.output_token_ids[3]
    first_stop = full.output_token_ids.index(stop)
    out = engine.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
    )[0]
    assert out.output_token_ids == full.output_token_ids[: first_stop + 1]
    assert out.finish_reason == "stop"


def test_update_weights_changes_generation_and_a_bad_sync_keeps_the_old(
    tiny_model_dir: Path,
) -> None:
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = engine.generate(PROMPTS, params)
    trained = _engine(tiny_model_dir).model  # a second copy, changed as training would
    torch.manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    named = list(trained.named_parameters())
    bad_syncs = {
        "missing": named[1:],
        "unexpected": [*named, ("model.extra.weight", torch.zeros(2))],
        "wrong_shape": [(n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(named)],
    }
    for label, sync in bad_syncs.items():
        with pytest.raises(WeightMismatchError) as info:
            _sync(engine, sync)
        assert getattr(info.value, label), label
        assert "keeps its previous weights" in str(info.value)
        assert engine.generate(PROMPTS, params) == before, f"{label}: weights changed"
    _sync(engine, named)
    after = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for o in after] == greedy_reference(trained, PROMPTS, 8)
    assert after != before and {o.weight_version for o in after} == {1}


def test_a_partial_sync_loads_what_it_sends_and_keeps_the_rest(tiny_model_dir: Path) -> None:
    """finish_partial_weight_update (a LoRA model's changed layers after a full sync):
    the sent tensors load, every other weight stays; names and shapes still checked."""
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    trained = _engine(tiny_model_dir).model
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "q_proj.weight" in name:
                p.add_(torch.randn_like(p) * 0.2)
    named = [(n, p) for n, p in trained.named_parameters() if "q_proj.weight" in n]
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.update_weights(named)
    engine.finish_partial_weight_update()
    for name, value in engine.model.named_parameters():
        want = dict(named).get(name, before[name])
        assert torch.equal(value, want), name
    out = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for o in out] == greedy_reference(trained, PROMPTS, 8)
    with pytest.raises(WeightMismatchError) as info:  # a full sync still needs every weight
        _sync(engine, named)
    assert info.value.missing
    with pytest.raises(WeightMismatchError):
        engine.update_weights([("model.extra.weight", torch.zeros(2))])


def test_a_partial_sync_after_a_level_2_sleep_leaves_generation_refused(
    tiny_model_dir: Path,
) -> None:
    """The level-2 sleep discarded every weight; a partial sync brings back some, so
    generation stays refused until a full sync (issue 35 defect 2)."""
    engine = _engine(tiny_model_dir)
    engine.sleep(2)
    engine.wake_up()
    named = [(n, p) for n, p in engine.model.named_parameters() if "q_proj.weight" in n]
    engine.update_weights(named)
    engine.finish_partial_weight_update()
    with pytest.raises(EngineError, match="level-2 sleep"):
        engine.generate(PROMPTS)
    _sync(engine, list(engine.model.named_parameters()))
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 3


def test_sleep_level_2_refuses_generation_until_the_next_sync(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    engine.sleep(2)
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(PROMPTS)
    engine.wake_up(["weights"])
    engine.update_weights(list(engine.model.named_parameters()))
    engine.finish_weight_update()
    engine.wake_up(["kv_cache"])
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 3


def test_bad_prompts_name_the_prompt_the_value_and_the_limit(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, engine_max_model_len=16)
    cases = {
        "prompt 1: a prompt is a non-empty list of token ids": [[1], []],
        r"prompt 0: token id 128 \(position 1\) is outside the vocabulary of 128": [[3, 128]],
        r"prompt 2: 12 prompt tokens \+ max_new_tokens=8 exceed the engine's "
        r"max_model_len=16": [[1], [2], [3] * 12],
    }
    for message, prompts in cases.items():
        with pytest.raises(PromptError, match=message):
            engine.generate(prompts, SamplingParams(max_new_tokens=8))


def test_a_prompt_with_images_is_refused_not_served_without_them(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    prompts: list[Any] = [[1, 2], {"prompt_token_ids": [3], "multi_modal_data": {"image": ["a"]}}]
    expected = (r"prompt 1 carries image items, but this hf engine serves a text-only "
                r"model \(no media_processor\); load a vision-language model, or use "
                r"engine_type='vllm' or 'sglang'")  # fmt: skip
    with pytest.raises(EngineError, match=expected):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_sglang_and_vllm_options_are_honoured_or_refused_by_name(tiny_model_dir: Path) -> None:
    """Upstream's SGLang dict reaches the HF engine: penalties at their no-op values and
    text-only options change nothing, repetition_penalty and min tokens are generate's
    own, and an option it cannot honour is refused, naming it."""
    engine = _engine(tiny_model_dir)
    greedy = engine.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0.0})
    upstream = {
        "n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "skip_special_tokens": False, "spaces_between_special_tokens": True, "ignore_eos": False,
    }  # fmt: skip
    same = engine.generate(PROMPTS, upstream)
    assert [o.output_token_ids for o in same] == [o.output_token_ids for o in greedy]
    penalised = engine.generate(PROMPTS, {**upstream, "repetition_penalty": 50.0})
    for out in penalised:  # a huge penalty: no generated token repeats an earlier one
        tokens = out.prompt_token_ids + out.output_token_ids
        start = len(out.prompt_token_ids)
        assert all(t not in tokens[: start + j] for j, t in enumerate(out.output_token_ids))
    assert penalised != same
    with pytest.raises(
        EngineError, match=r"cannot honour sampling option\(s\) presence_penalty=0.5"
    ):
        engine.generate(PROMPTS, {**upstream, "presence_penalty": 0.5})
