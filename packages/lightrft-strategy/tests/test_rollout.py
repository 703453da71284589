"""The inference-engine calls every strategy has: setup, weight sync in buckets,
generation split over tensor-parallel groups, and sleep/wake, against lightrft-testing's
FakeEngine (which records every tensor it receives and enforces the sleep levels)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.engines import EngineError, PromptError, SamplingParams
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing import FakeEngine, tensor_digest
from lightrft.testing.harness import train_sync_generate
from lightrft.testing.launcher import run_distributed

from . import workers


@pytest.fixture
def single() -> Iterator[Callable[..., FSDP2Strategy]]:
    """Build FSDP2 strategies in this process (a world of one); each is closed after the
    test (with its engine and process group)."""
    made: list[FSDP2Strategy] = []

    def make(**fields: object) -> FSDP2Strategy:
        made.append(FSDP2Strategy(device="cpu", **fields))
        return made[-1]

    yield make
    for strategy in reversed(made):
        strategy.close()


def test_weight_sync_sends_every_parameter_in_buckets_with_mapped_names(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    model = workers.TinyRegressor()
    engine = strategy.setup_inference_engine(FakeEngine())
    counts = strategy.update_engine_weights(
        model,
        bucket_bytes=3000,
        name_map=lambda name: None if name.startswith("head.") else f"model.{name}",
    )
    sent = engine.syncs[-1]
    params = dict(model.named_parameters())
    assert set(sent) == {f"model.{n}" for n in params if not n.startswith("head.")}
    for name, record in sent.items():
        param = params[name.removeprefix("model.")]
        assert record.shape == tuple(param.shape) and record.dtype == torch.float32
        assert record.sha256 == tensor_digest(param)
    assert (counts["tensors"], counts["buckets"]) == (len(sent), len(engine.bucket_sizes))
    assert counts["bytes"] == sum(4 * p.numel() for n, p in params.items() if "head" not in n)
    assert counts["weight_version"] == 1 == len(engine.syncs)
    assert counts["gather_s"] >= 0 and counts["load_s"] > 0
    assert len(engine.bucket_sizes) > 1 and sum(engine.bucket_sizes) == len(sent)
    strategy.update_engine_weights(model, dtype=torch.bfloat16)
    assert {r.dtype for r in engine.syncs[-1].values()} == {torch.bfloat16}


def test_an_engine_that_pulls_gets_the_whole_sync_in_one_call_tensor_by_tensor(
    single: Callable[..., FSDP2Strategy],
) -> None:
    """An engine with ``update_weights_stream`` (vLLM) gets one call per sync and pulls
    each tensor, which is gathered only then: no bucket is ever held."""
    strategy = single()
    model = workers.TinyRegressor()
    engine = strategy.setup_inference_engine(FakeEngine(weight_stream=True))
    events: list[str] = []
    gather = strategy.iter_full_parameters

    def logged(m: Any) -> Any:
        for name, tensor in gather(m):
            events.append(f"gather {name}")
            yield name, tensor

    strategy.iter_full_parameters = logged  # type: ignore[method-assign]
    update = engine.update_weights
    engine.update_weights = lambda items: (  # type: ignore[method-assign]
        events.extend(f"load {n}" for n, _ in items),
        update(items),
    )
    counts = strategy.update_engine_weights(
        model, bucket_bytes=1, name_map=lambda n: None if n.startswith("head.") else f"m.{n}"
    )
    params = dict(model.named_parameters())
    kept = [n for n in params if not n.startswith("head.")]
    # each tensor is loaded right after its gather (dropped names are gathered, not sent)
    assert events == [
        e for n in params for e in (f"gather {n}", f"load m.{n}")[: 2 if n in kept else 1]
    ]
    assert {n: r.sha256 for n, r in engine.syncs[-1].items()} == {
        f"m.{n}": tensor_digest(params[n]) for n in kept
    }
    assert (counts["tensors"], counts["buckets"], engine.bucket_sizes) == (
        len(kept), 1, [len(kept)]
    )  # fmt: skip
    assert counts["bytes"] == sum(4 * params[n].numel() for n in kept)
    assert counts["gather_s"] >= 0 and counts["load_s"] > 0 and counts["weight_version"] == 1
    strategy.update_engine_weights(model, dtype=torch.bfloat16)
    assert {r.dtype for r in engine.syncs[-1].values()} == {torch.bfloat16}


def test_two_parameters_mapped_to_one_engine_name_are_refused_before_any_gather(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    model = workers.TinyRegressor()
    engine = strategy.setup_inference_engine(FakeEngine(weight_stream=True))
    with pytest.raises(
        ValueError, match=r"name_map maps both 'head.weight' and 'head.bias' to 'head'"
    ):
        strategy.update_engine_weights(
            model, name_map=lambda n: n.split(".")[0] if "head" in n else n
        )
    assert engine.syncs == [] and not engine.state.weights_stale


def test_an_engine_that_stops_pulling_early_is_an_error_and_every_gather_still_runs(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    model = workers.TinyRegressor()
    engine = FakeEngine()
    read: list[str] = []

    def two_then_return(named_tensors: Any) -> None:  # a broken engine: stops reading
        for name, _ in named_tensors:
            read.append(name)
            if len(read) == 2:
                return

    engine.update_weights_stream = two_then_return  # type: ignore[attr-defined]
    strategy.setup_inference_engine(engine)
    gathered: list[str] = []
    gather = strategy.iter_full_parameters

    def counted(m: Any) -> Any:
        for name, tensor in gather(m):
            gathered.append(name)  # collective on a sharded model: every rank must run it
            yield name, tensor

    strategy.iter_full_parameters = counted  # type: ignore[method-assign]
    total = len(list(model.parameters()))
    with pytest.raises(
        EngineError,
        match=rf"FakeEngine.update_weights_stream returned with {total - 2} tensor\(s\) "
        "unread: the engine's weights are incomplete",
    ):
        strategy.update_engine_weights(model)
    assert len(read) == 2 and gathered == [n for n, _ in model.named_parameters()]


def test_generations_follow_the_synced_weights(single: Callable[..., FSDP2Strategy]) -> None:
    """FakeEngine's generations are a function of the weights it holds: a sync of the
    same weights leaves them as they were, a changed weight changes them."""
    strategy = single()
    model = workers.TinyRegressor()
    strategy.setup_inference_engine(FakeEngine())
    sampling = SamplingParams(max_new_tokens=8, n=2, seed=1)
    prompts = [[1, 2, 3], [4]]
    unsynced = strategy.gather_and_generate(prompts, sampling)
    strategy.update_engine_weights(model)
    synced = strategy.gather_and_generate(prompts, sampling)
    assert synced != unsynced
    strategy.update_engine_weights(model, bucket_bytes=3000)  # same weights, other buckets
    again = strategy.gather_and_generate(prompts, sampling)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in synced]
    assert {o.weight_version for o in again} == {2} and {o.weight_version for o in synced} == {1}
    copy = workers.TinyRegressor()
    copy.load_state_dict(model.state_dict())
    other = single()
    other.setup_inference_engine(FakeEngine())
    other.update_engine_weights(copy)  # another engine, the same weights: the same outputs
    assert other.gather_and_generate(prompts, sampling) == synced

    original = model.head.bias.detach().clone()
    with torch.no_grad():
        model.head.bias[0] += 1.0
    strategy.update_engine_weights(model)
    changed = strategy.gather_and_generate(prompts, sampling)
    pairs = zip(changed, synced, strict=True)
    assert all(a.output_token_ids != b.output_token_ids for a, b in pairs)
    assert strategy.gather_and_generate(prompts, sampling) == changed  # deterministic
    with torch.no_grad():
        model.head.bias.copy_(original)
    strategy.update_engine_weights(model)
    restored = strategy.gather_and_generate(prompts, sampling)
    assert [o.output_token_ids for o in restored] == [o.output_token_ids for o in synced]


def test_a_mismatched_weight_name_is_an_error_naming_it(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    model = workers.TinyRegressor()
    engine = FakeEngine(expected_weights=[n for n, _ in model.named_parameters()])
    strategy.setup_inference_engine(engine)
    with pytest.raises(EngineError, match=r"not parameters .*model.layers.0.norm.weight.*name_map"):
        strategy.update_engine_weights(model, name_map=lambda n: f"model.{n}")
    with pytest.raises(EngineError, match=r"missing \(2\): head.bias, head.weight\b"):
        strategy.update_engine_weights(model, name_map=lambda n: None if "head" in n else n)
    assert engine.syncs == []  # nothing half-applied


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


def test_engine_calls_need_an_engine(single: Callable[..., FSDP2Strategy]) -> None:
    strategy = single()
    with pytest.raises(RuntimeError, match=r"setup_inference_engine\(\.\.\.\) first"):
        strategy.gather_and_generate([[1]])
    with pytest.raises(TypeError, match=r"object is not an inference engine: it lacks generate"):
        strategy.setup_inference_engine(object())


BACKENDS = [
    pytest.param({"backend": "fsdp2"}, id="fsdp2"),
    pytest.param(
        {"backend": "deepspeed", "zero_stage": 3}, id="zero3", marks=pytest.mark.deepspeed
    ),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("leader_only", "stream"),
    [(False, False), (True, False), (False, True)],
    ids=["every-rank", "leader-only", "stream"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_calls_on_two_ranks_with_a_sharded_model(
    backend: dict[str, object], leader_only: bool, stream: bool
) -> None:
    cfg = workers.config(
        engine_tp_size=2, enable_engine_sleep=True, engine_sleep_level=2, **backend
    )
    r0, r1 = run_distributed(
        workers.rollout_case, 2, cfg, leader_only, stream, init_process_group=False
    )
    for r in (r0, r1):
        # each rank gets exactly its own prompts' outputs (n=2 each), in order
        assert r["before"] == r["expected_before"]
        assert r["after"] != r["before"]  # the synced weights changed the generations
        assert r["again"] == r["after"]  # same weights after sleep + resync
        assert r["slept"] is True and "asleep" in r["errors"][0]
        assert r["syncs"] == 2
        # streamed: one call pulling every gathered tensor; else buckets of 4096 bytes
        assert (r["counts"]["buckets"] == 1) if stream else (r["counts"]["buckets"] > 1)
        assert sum(r["buckets"]) == r["counts"]["tensors"] == len(r["record"])
    assert [len(r0["before"]), len(r1["before"])] == [6, 2]
    assert r0["prompts_back"] == [[1, 2, 3]] * 2 + [[4]] * 2 + [[5, 6]] * 2
    # the engine received the full (gathered) tensors, the same on both ranks
    assert r0["record"] == r1["record"] == {n: v for n, v in r0["full"].items()}
    calls = [r0["generate_calls"], r1["generate_calls"]]
    assert calls == ([3, 0] if leader_only else [3, 3])


@pytest.mark.distributed
@pytest.mark.parametrize("stream", [False, True], ids=["buckets", "stream"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_failing_on_one_rank_does_not_hang_the_others(
    backend: dict[str, object], stream: bool
) -> None:
    """Rank 1's engine raises mid-sync: rank 1 still gathers the rest (each gather of a
    sharded parameter is a collective), so rank 0 completes its sync."""
    cfg = workers.config(**backend)
    r0, r1 = run_distributed(
        workers.one_engine_fails_case, 2, cfg, stream, init_process_group=False, timeout=120
    )
    total = len(list(workers.TinyRegressor().parameters()))
    assert (r0["error"], r0["syncs"], r0["taken"]) == ("", 1, total)
    assert (r1["error"], r1["syncs"], r1["taken"]) == ("the engine failed on rank 1", 0, 3)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_hf_engine_generates_from_the_trained_weights_on_two_ranks(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    from lightrft.testing.models import save_tiny_qwen2

    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    cfg = workers.config(
        **backend, train_batch_size=4, micro_train_batch_size=2, actor_learning_rate=1e-2,
        max_norm=1.0, engine_type="hf",
    )  # fmt: skip
    ranks = run_distributed(
        train_sync_generate, 2, cfg, model_dir, init_process_group=False, timeout=300
    )
    expected = ranks[0]["expected"]
    assert ranks[0]["engine"] == "HFEngine"
    assert ranks[0]["after"] == expected[:3] and ranks[1]["after"] == expected[3:]
    assert ranks[0]["prompts_back"] == [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7]]
    assert ranks[1]["prompts_back"] == [[11, 12]]
    assert ranks[0]["before"] != ranks[0]["after"], "training did not change the output"
    # engine_tp_size=1: each rank checks its own prompts (rank 0's were fine)
    assert "prompt" not in ranks[0]["errors"]
    message = ranks[1]["errors"]["prompt"]
    assert (
        "prompt 1 of rank 1: token id 500 (position 0) is outside the vocabulary of 128" in message
    )
    for r in ranks:
        assert r["versions"] == [1]
        stats = r["stats"]
        assert stats["buckets"] > 1 and stats["bytes"] > 64 * 1024
        assert stats["max_logprob_gap"] < 1e-3  # verify=True passed
        assert r["usable"], "the engine was not usable after a refused prompt"
        assert "x.model.embed_tokens.weight" in r["errors"]["names"]
        assert "keeps its previous weights" in r["errors"]["names"] and r["kept"]
        assert "the engine's weights are not the trainer's" in r["errors"]["stale"]


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


def test_engine_generate_local_and_bad_prompts_name_rank_index_and_limit(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine(vocab_size=16))
    local = strategy.engine_generate_local(
        SamplingParams(max_new_tokens=2), prompt_token_ids=[[1], [2, 3]]
    )
    assert [o.prompt_token_ids for o in local] == [[1], [2, 3]]
    with pytest.raises(ValueError, match="exactly one of prompt_token_ids and multi_modal_inputs"):
        strategy.engine_generate_local(SamplingParams(), None, None)
    with pytest.raises(PromptError, match=r"prompt 1 of rank 0: token id 16 \(position 1\) "
                       r"is outside the vocabulary of 16"):  # fmt: skip
        strategy.gather_and_generate([[1], [2, 16]])
    with pytest.raises(PromptError, match="prompt 0 of rank 0: a prompt is a non-empty list"):
        strategy.gather_and_generate([[]])


def test_verification_needs_logprobs_and_names_the_engine(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(EngineError, match="FakeEngine returned no logprobs"):
        strategy.update_engine_weights(workers.TinyRegressor(), verify=True)


def test_upstream_multimodal_inputs_nested_or_flat() -> None:
    from lightrft.engines.multimodal import MediaError
    from lightrft.strategy.engine_link import build_multimodal_inputs

    a, b, c, v = "a.png", "b.png", "c.png", "v.mp4"
    nested = build_multimodal_inputs(["p0", "p1", "p2"], [[a, b], [c], None], [2, 1, 0],
                                     None, None)  # fmt: skip
    flat = build_multimodal_inputs(["p0", "p1", "p2"], [a, b, c], [2, 1, 0], [v], [0, 0, 1])
    assert nested[0] == {"prompt": "p0", "multi_modal_data": {"image": [a, b]}}
    assert nested[1] == {"prompt": "p1", "multi_modal_data": {"image": [c]}}
    assert nested[2] == {"prompt": "p2"}
    assert flat[:2] == nested[:2]
    assert flat[2] == {"prompt": "p2", "multi_modal_data": {"video": [v]}}
    # nested without counts keeps every image (upstream's code dropped them all)
    no_counts = build_multimodal_inputs(["p0", "p1"], [[a, b], [c]], None, None, None)
    assert [x["multi_modal_data"]["image"] for x in no_counts] == [[a, b], [c]]
    with pytest.raises(MediaError, match=r"prompt 1: image count 2 but only 1 image"):
        build_multimodal_inputs(["p0", "p1"], [a, b, c], [2, 2], None, None)
    # as upstream: a templated prompt left without images loses its vision placeholders
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe."
    assert build_multimodal_inputs([text], [None], [0], None, None) == [{"prompt": "Describe."}]


def test_another_modality_goes_through_gather_and_generate_by_its_keywords(
    single: Callable[..., FSDP2Strategy],
) -> None:
    from lightrft.engines.multimodal import Modality, register_modality, unregister_modality

    strategy = single()
    engine = strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['all_audios'\]"):
        strategy.gather_and_generate(SamplingParams(), all_prompt_token_ids=[[1]],
                                     all_audios=[["x.wav"]])  # fmt: skip
    register_modality(Modality("audio", "all_audios", "audios_num", "audio_data"))
    try:
        strategy.gather_and_generate(SamplingParams(), all_prompt_token_ids=[[1], [2]],
                                     all_audios=["x.wav", "y.wav"], audios_num=[0, 2])  # fmt: skip
    finally:
        unregister_modality("audio")
    assert engine.last_prompts == [
        {"prompt_token_ids": [1]},
        {"prompt_token_ids": [2], "multi_modal_data": {"audio": ["x.wav", "y.wav"]}},
    ]


@pytest.mark.distributed
def test_every_image_of_every_rank_reaches_the_engine_in_order() -> None:
    cfg = workers.config(engine_tp_size=2)
    ranks = run_distributed(workers.multimodal_gather_case, 2, cfg, init_process_group=False)
    expected = [
        {"prompt_token_ids": [1], "multi_modal_data": {"image": ["r0p0a", "r0p0b"]}},
        {"prompt_token_ids": [2], "multi_modal_data": {"image": ["r0p1a"]}},
        {"prompt_token_ids": [3], "multi_modal_data": {"image": ["r1p0a", "r1p0b", "r1p0c"]}},
    ]
    for r in ranks:  # the engine of each rank of the group got the group's prompts
        assert r["seen"] == expected
        assert r["calls_after_error"] == 0
    assert ranks[0]["mine"] == [[1], [2]] and ranks[1]["mine"] == [[3]]
    for r in ranks:  # both ranks refuse, naming rank 1
        assert "rank 1: the image counts add up to 1 but 2 image(s)" in r["error"]


@pytest.mark.distributed
def test_a_bad_prompt_is_refused_by_every_rank_of_the_tp_group_before_generating() -> None:
    cfg = workers.config(engine_tp_size=2)
    ranks = run_distributed(workers.tp_group_bad_prompt_case, 2, cfg, init_process_group=False)
    for r in ranks:
        assert r["error"] is not None and "prompt 1 of rank 1: token id 99" in r["error"]
        assert r["calls_after_error"] == 0  # nobody generated
    assert ranks[0]["prompts"] == [[4], [5]] and ranks[1]["prompts"] == [[3]]


def test_is_engine_tells_engines_from_models() -> None:
    from lightrft.strategy import is_engine

    assert is_engine(FakeEngine())
    assert not is_engine(workers.TinyRegressor()) and not is_engine(None)


def test_gather_and_generate_without_prompts_says_how_to_call_it(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(TypeError, match="got no prompts"):
        strategy.gather_and_generate([1, 2, 3])  # one prompt, not a list of prompts
    with pytest.raises(TypeError, match="got no prompts"):
        strategy.gather_and_generate(SamplingParams())


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
