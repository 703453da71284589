"""Weight sync to the rollout engine (:mod:`lightrft.strategy.engine_link.weight_sync`):
buckets, engines that pull the tensors, name checks, verification, and the engine
calls on two ranks with a sharded model (where the sync's gathers are collectives),
against lightrft-testing's FakeEngine (which records every tensor it receives) and the
real Hugging Face engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.engines import EngineError, SamplingParams
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing import FakeEngine, tensor_digest
from lightrft.testing.harness import train_sync_generate
from lightrft.testing.launcher import run_distributed

from . import workers


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
    gather = strategy.backend.iter_full_parameters

    def logged(m: Any) -> Any:
        for name, tensor in gather(m):
            events.append(f"gather {name}")
            yield name, tensor

    strategy.backend.iter_full_parameters = logged  # type: ignore[method-assign]
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
    gather = strategy.backend.iter_full_parameters

    def counted(m: Any) -> Any:
        for name, tensor in gather(m):
            gathered.append(name)  # collective on a sharded model: every rank must run it
            yield name, tensor

    strategy.backend.iter_full_parameters = counted  # type: ignore[method-assign]
    total = len(list(model.parameters()))
    with pytest.raises(
        EngineError,
        match=rf"FakeEngine.update_weights_stream returned with {total - 2} tensor\(s\) "
        "unread: the engine's weights are incomplete",
    ):
        strategy.update_engine_weights(model)
    assert len(read) == 2 and gathered == [n for n, _ in model.named_parameters()]


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


def test_verification_needs_logprobs_and_names_the_engine(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(EngineError, match="FakeEngine returned no logprobs"):
        strategy.update_engine_weights(workers.TinyRegressor(), verify=True)


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


def test_a_sync_of_unchanged_weights_says_so_and_is_skipped_when_asked(
    single: Callable[..., FSDP2Strategy], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine holds the trainer's weights until an optimizer step, a load or a
    discarding sleep changes that: a sync then says so, and ``skip_unchanged`` sends
    nothing (an evaluation and the training step after it share one sync)."""
    strategy = single(train_batch_size=2, micro_train_batch_size=2, bf16=False, max_norm=1.0)
    model = strategy.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = strategy.create_optimizer(model)
    engine = strategy.setup_inference_engine(FakeEngine())
    first = strategy.update_engine_weights(model, skip_unchanged=True)
    assert first["tensors"] > 0 and "skipped" not in first and len(engine.syncs) == 1
    with caplog.at_level("INFO", logger="lightrft.strategy.engine_link"):
        held = strategy.update_engine_weights(model, skip_unchanged=True)
        assert held["skipped"] is True and held["tensors"] == 0 and len(engine.syncs) == 1
        assert "the engine holds these weights already" in caplog.text
        assert strategy.update_engine_weights(model)["tensors"] == first["tensors"]  # default
        assert "sending them again" in caplog.text and len(engine.syncs) == 2
    assert not workers.grads_step(strategy, model, optim, float("nan"))  # a skipped step
    assert strategy.update_engine_weights(model, skip_unchanged=True)["skipped"]
    assert workers.grads_step(strategy, model, optim, 1.0)  # an applied step
    stepped = strategy.update_engine_weights(model, skip_unchanged=True)
    assert "skipped" not in stepped and engine.syncs[-1] != engine.syncs[-2]
    torch.save(workers.TinyRegressor().state_dict(), tmp_path / "other.pt")
    strategy.load_model(model, tmp_path / "other.pt")  # a load changes the weights too
    assert "skipped" not in strategy.update_engine_weights(model, skip_unchanged=True)
    assert strategy.update_engine_weights(model, skip_unchanged=True)["skipped"]
    # another dtype is another sync
    assert "skipped" not in strategy.update_engine_weights(
        model, dtype=torch.bfloat16, skip_unchanged=True
    )
    # a level-2 sleep discards the engine's weights: they are sent
    sleeper = single(enable_engine_sleep=True, engine_sleep_level=2)
    plain = workers.TinyRegressor()
    sleepy = sleeper.setup_inference_engine(FakeEngine())
    sleeper.update_engine_weights(plain)
    sleeper.maybe_sleep_inference_engine()
    assert "skipped" not in sleeper.update_engine_weights(plain, skip_unchanged=True)
    assert len(sleepy.syncs) == 2
