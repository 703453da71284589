"""How far the rollout engine's log-probabilities are from the trainer's, and the
truncated importance-sampling weights that correct a policy loss for the gap.

An inference engine (vLLM, SGLang, even the HF engine in another precision) samples from
a distribution that is not exactly the trainer's: kernels, precision and weight-sync
timing differ. The engines report each sampled token's log-probability under the
distribution it was drawn from (``SamplingParams(logprobs=True)``, see
:class:`lightrft.engines.SamplingParams`); the trainer recomputes the same tokens'
log-probabilities. These helpers compare the two and weight the loss by
``min(pi_trainer / pi_engine, cap)`` per token (truncated importance sampling), the
correction that keeps a policy gradient unbiased up to the cap when samples come from a
slightly different policy.

Both take ``(batch, tokens)`` tensors and an optional mask of the same shape (1 for a
completion token, 0 for padding).
"""

from __future__ import annotations

import torch

__all__ = ["logprob_mismatch", "truncated_importance_weights"]


def logprob_mismatch(
    engine_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-token gap between the engine's and the trainer's log-probabilities of the
    sampled tokens, over the masked tokens:

    - ``logprob_abs_diff``: mean ``|engine - trainer|``;
    - ``logprob_max_abs_diff``: the largest ``|engine - trainer|``;
    - ``rollout_kl``: an estimate of KL(engine || trainer) from the engine's samples,
      the mean of ``exp(r) - r - 1`` with ``r = trainer - engine`` (Schulman's k3:
      unbiased and never negative);
    - ``tokens``: how many tokens were compared.
    """
    if engine_logprobs.shape != trainer_logprobs.shape:
        raise ValueError(
            f"engine log-probs of shape {tuple(engine_logprobs.shape)} and trainer "
            f"log-probs of shape {tuple(trainer_logprobs.shape)}: pass one value per "
            "sampled token, both padded to the same (batch, tokens)"
        )
    engine = engine_logprobs.detach().float()
    trainer = trainer_logprobs.detach().float().to(engine.device)
    keep = (
        torch.ones_like(engine, dtype=torch.bool) if mask is None else mask.to(engine.device).bool()
    )
    count = int(keep.sum())
    if count == 0:
        return {"logprob_abs_diff": 0.0, "logprob_max_abs_diff": 0.0, "rollout_kl": 0.0,
                "tokens": 0}  # fmt: skip
    ratio = (trainer - engine)[keep].double()  # exp(r) - r - 1 of tiny r: float32 rounds below 0
    return {
        "logprob_abs_diff": float(ratio.abs().mean()),
        "logprob_max_abs_diff": float(ratio.abs().max()),
        "rollout_kl": float((ratio.exp() - ratio - 1).mean()),
        "tokens": count,
    }


def truncated_importance_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    cap: float = 2.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``min(exp(trainer - engine), cap)`` per token, detached (a weight, not a path for
    gradients), 0 where ``mask`` is 0. Multiply a per-token policy-gradient loss by it.

    ``trainer_logprobs`` are the log-probabilities of the policy the samples are meant
    to come from (the trainer's, before this step's update). Where they equal the
    engine's, every weight is 1 and the loss is unchanged.
    """
    if cap <= 0:
        raise ValueError(f"cap={cap}: the importance-weight cap must be > 0 (2.0 is usual)")
    log_ratio = trainer_logprobs.detach().float() - engine_logprobs.detach().float().to(
        trainer_logprobs.device
    )
    weights = log_ratio.exp().clamp(max=cap)
    if mask is not None:
        weights = weights * mask.to(weights.device, weights.dtype)
    return weights
