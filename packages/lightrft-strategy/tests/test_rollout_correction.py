"""The rollout-mismatch metrics and truncated importance weights."""

from __future__ import annotations

import math

import pytest
import torch

from lightrft.strategy.rollout_correction import logprob_mismatch, truncated_importance_weights


def test_mismatch_of_known_gaps_over_the_masked_tokens() -> None:
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    trainer = torch.tensor([[-1.1, -2.0, -2.5], [-0.5, -0.7, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token is padding: ignored
    got = logprob_mismatch(engine, trainer, mask)
    gaps = [-0.1, 0.0, 0.5, 0.0, -0.2]
    assert got["tokens"] == 5
    assert got["logprob_abs_diff"] == pytest.approx(sum(abs(g) for g in gaps) / 5)
    assert got["logprob_max_abs_diff"] == pytest.approx(0.5)
    k3 = sum(math.exp(g) - g - 1 for g in gaps) / 5
    assert got["rollout_kl"] == pytest.approx(k3)


def test_identical_log_probs_give_no_mismatch_and_unit_weights() -> None:
    logp = torch.randn(4, 6).log_softmax(-1)
    got = logprob_mismatch(logp, logp.clone())
    assert (got["logprob_abs_diff"], got["logprob_max_abs_diff"], got["rollout_kl"]) == (0, 0, 0)
    assert torch.equal(truncated_importance_weights(logp, logp.clone()), torch.ones(4, 6))


def test_importance_correction_changes_nothing_when_the_log_probs_match_exactly() -> None:
    """The same policy-gradient loss and gradient with and without the correction when
    the engine's log-probs are the trainer's."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5))
    advantages = torch.randn(3, 1)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    grads = []
    for correct in (False, True):
        logp = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        weight = truncated_importance_weights(logp, logp.detach(), 2.0, mask) if correct else 1.0
        loss = -(weight * advantages * logp * mask).sum() / mask.sum()
        (grad,) = torch.autograd.grad(loss, logits)
        grads.append((float(loss.detach()), grad))
    assert grads[0][0] == grads[1][0]
    assert torch.equal(grads[0][1], grads[1][1])


def test_weights_are_capped_detached_and_masked() -> None:
    trainer = torch.tensor([[0.0, -1.0, 0.0]], requires_grad=True)
    engine = torch.tensor([[-2.0, -1.0, -0.5]])
    weights = truncated_importance_weights(trainer, engine, cap=2.0, mask=torch.tensor([[1, 1, 0]]))
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.0]]))  # e^2 capped at 2


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*shape \(2, 4\)"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="cap=0"):
        truncated_importance_weights(torch.zeros(1), torch.zeros(1), cap=0)
