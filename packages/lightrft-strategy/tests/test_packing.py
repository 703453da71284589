"""Packed rows and token-budget micro-batches.

One process: a packed row gives each sample the log-probabilities it has alone (no
attention leaks into a neighbour), and the language-model head runs on loss tokens
only. Real gloo ranks, FSDP2 and ZeRO-2/3: a skewed step (rank 1's samples several
times longer) trained in packed token-budget micro-batches equals the same step in
fixed padded micro-batches: loss, per-sample log-probabilities, every gradient, the
parameters after three steps; at ``sp_size = 2`` on packed rows too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightrft.strategy.packing import build_batch, token_logprobs
from lightrft.testing.launcher import run_distributed
from lightrft.testing.models import tiny_hf_causal_lm

from .packing_workers import BUDGET, train_case

SAMPLES = [([3, 4, 5], [6, 7, 8, 9, 10]), ([11, 12, 13, 14], list(range(20, 40))),
           ([15, 16], [17]), ([40, 41, 42, 43, 44, 45], list(range(50, 59)))]  # fmt: skip


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return tiny_hf_causal_lm(attn_implementation="sdpa")


def test_packed_rows_give_each_sample_its_padded_log_probabilities(model: Any) -> None:
    packed = build_batch(SAMPLES, range(4), packed=True)
    padded = build_batch(SAMPLES, range(4), packed=False)
    assert packed.input_ids.shape == (1, 8 + 24 + 3 + 15)
    assert packed.sample_tokens.tolist() == [5, 20, 1, 9]
    a, _ = token_logprobs(model, packed)
    b, _ = token_logprobs(model, padded)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # the trainer's shape: [samples, longest completion]
    rows = packed.to_rows(a)
    assert rows.shape == (4, 20) and torch.equal(rows[2, 1:], torch.zeros(19))


def test_a_sample_never_attends_to_its_neighbour_in_a_packed_row(model: Any) -> None:
    base, _ = token_logprobs(model, build_batch(SAMPLES, range(4), packed=True))
    changed = [([99, 98, 97], [96, 95, 94, 93, 92]), *SAMPLES[1:]]
    after, _ = token_logprobs(model, build_batch(changed, range(4), packed=True))
    batch = build_batch(SAMPLES, range(4), packed=True)
    for i, (x, y) in enumerate(zip(batch.split(base), batch.split(after), strict=True)):
        if i == 0:
            assert not torch.allclose(x, y)  # the changed sample itself moves
        else:
            assert torch.equal(x, y), f"sample {i} saw sample 0's tokens"


def test_the_lm_head_runs_on_the_loss_tokens_only(model: Any) -> None:
    seen: list[int] = []
    handle = model.lm_head.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[1]))
    try:
        token_logprobs(model, build_batch(SAMPLES, range(4), packed=True))
    finally:
        handle.remove()
    assert seen == [5 + 20 + 1 + 9]  # not the 50 tokens of the row


def test_an_empty_micro_batch_backpropagates_zero(model: Any) -> None:
    logp, _ = token_logprobs(model, build_batch(SAMPLES, [], packed=True))
    assert logp.shape == (0,)
    model.zero_grad()
    logp.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def assert_same_step(ranks: list[dict[str, Any]], mode: str, ref: str = "padded") -> None:
    for rank in ranks:
        got, want = rank[mode], rank[ref]
        assert len(set(r[mode]["counts"][0] for r in ranks)) == 1  # same count on each rank
        assert got["global_steps"] == want["global_steps"] == 3  # one optimizer step each
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        for i, (x, y) in enumerate(zip(got["logps"], want["logps"], strict=True)):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5, msg=f"sample {i}")
        for name, grad in want["grads"].items():
            other = got["grads"][name]
            assert torch.allclose(other, grad, atol=1e-6, rtol=1e-4), (
                f"{mode}: gradient of {name} differs by {(other - grad).abs().max():.3g}"
            )
        for name, value in want["params"].items():
            other = got["params"][name]
            assert torch.allclose(other, value, atol=1e-4, rtol=1e-4), (
                f"{mode}: parameter {name} differs by {(other - value).abs().max():.3g}"
            )


def assert_as_defined(ranks: list[dict[str, Any]], mode: str, definition: str) -> None:
    """The step's loss and gradients are those of the loss's definition over every
    rank's samples, computed in one process without a strategy."""
    want = ranks[0]["reference"][definition]
    got = ranks[0][mode]
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    for name, grad in want["grads"].items():
        assert torch.allclose(got["grads"][name], grad, atol=1e-6, rtol=1e-4), (
            f"{mode}: gradient of {name} differs from {definition}'s by "
            f"{(got['grads'][name] - grad).abs().max():.3g}"
        )


def assert_budget_kept(ranks: list[dict[str, Any]]) -> None:
    """Padded: 3 fixed micro-batches. Packed: fewer tokens computed, every micro-batch
    under the budget but the one of rank 1's long sample, which runs alone."""
    for rank in ranks:
        assert rank["padded"]["counts"][0] == 3
        packed, padded = rank["packed"]["batches"], rank["padded"]["batches"]
        assert sum(t for t, _ in packed) < sum(t for t, _ in padded)
        assert all(tokens <= BUDGET or samples == 1 for tokens, samples in packed)
    assert any(t > BUDGET and n == 1 for t, n in ranks[1]["packed"]["batches"])


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp2_packed_token_budget_step_equals_the_fixed_padded_step() -> None:
    ranks = run_distributed(train_case, 2, {"backend": "fsdp2"},
                            ["padded", "packed", "packed_sp2", "packed_seq_mean"],
                            timeout=500)  # fmt: skip
    assert_as_defined(ranks, "padded", "token-mean")
    assert_as_defined(ranks, "packed_seq_mean", "seq-mean-token-mean")
    assert_same_step(ranks, "packed")
    assert_same_step(ranks, "packed_sp2", ref="packed")
    # at sp_size 2 each rank's LM head runs on the pair's loss tokens in its half of
    # the sequence (not on its own rows' tokens, gathered whole): together once what
    # the two heads see at sp_size 1, and rank 1's long samples shared with rank 0
    sp1 = [sum(r["packed"]["lm_head_tokens"]) for r in ranks]
    sp2 = [sum(r["packed_sp2"]["lm_head_tokens"]) for r in ranks]
    assert sum(sp2) == sum(sp1) and max(sp2) < max(sp1), (sp1, sp2)
    assert_budget_kept(ranks)


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_packed_token_budget_step_equals_the_fixed_padded_step(stage: int) -> None:
    ranks = run_distributed(train_case, 2, {"backend": "deepspeed", "zero_stage": stage},
                            ["padded", "packed"], timeout=500)  # fmt: skip
    assert_as_defined(ranks, "padded", "token-mean")
    assert_same_step(ranks, "packed")
    assert_budget_kept(ranks)


def test_the_packed_attention_runs_each_sample_apart_with_the_same_results() -> None:
    """use_packed_attention: SDPA sample by sample on a packed row (no T x T mask):
    the padded log-probabilities and gradients, no leak; padded rows unchanged."""
    from lightrft.strategy.packing import PACKED_ATTENTION, use_packed_attention

    torch.manual_seed(0)
    plain = tiny_hf_causal_lm(attn_implementation="sdpa")
    packed_model = tiny_hf_causal_lm(attn_implementation="sdpa")
    packed_model.load_state_dict(plain.state_dict())
    use_packed_attention(packed_model)
    assert packed_model.config._attn_implementation == PACKED_ATTENTION
    packed, padded = (build_batch(SAMPLES, range(4), packed=p) for p in (True, False))
    want, _ = token_logprobs(plain, padded)
    got, _ = token_logprobs(packed_model, packed)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(token_logprobs(packed_model, padded)[0], want, atol=0, rtol=0)
    want.sum().backward()
    got.sum().backward()
    for (name, a), b in zip(plain.named_parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    changed = [([99, 98, 97], [96, 95, 94, 93, 92]), *SAMPLES[1:]]
    after, _ = token_logprobs(packed_model, build_batch(changed, range(4), packed=True))
    for i, (x, y) in enumerate(zip(packed.split(got), packed.split(after), strict=True)):
        assert i == 0 or torch.equal(x, y), f"sample {i} saw sample 0's tokens"


def test_a_packed_row_attends_in_groups_of_similar_length() -> None:
    """One long sample and many short ones: the short ones are not padded to the long
    one's width (each group's longest is under twice its shortest)."""
    from lightrft.strategy.packing import length_buckets

    lengths = [384, 12, 40, 9, 200, 30, 3, 16]
    buckets = length_buckets(lengths)
    assert buckets == [[0, 4], [2, 5], [7, 1, 3], [6]]
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        assert all(2 * lengths[i] > lengths[bucket[0]] >= lengths[i] for i in bucket)
    assert length_buckets([]) == [] and length_buckets([5, 5, 5]) == [[0, 1, 2]]
