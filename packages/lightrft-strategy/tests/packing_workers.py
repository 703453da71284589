"""Rank functions for the token-budget micro-batch tests (importable by the launcher).

Each rank holds its own samples of a GRPO-like step: prompts and completions, one
advantage per sample. The lengths are skewed: rank 1's completions are several times
longer than rank 0's. A *mode* trains a tiny Qwen2 a few steps on them with
``plan_micro_batches``: ``padded`` (fixed micro-batches of ``micro_train_batch_size``
right-padded rows), ``packed`` (packed rows under ``max_tokens_per_gpu``), and either
at ``sp_size`` 2. Each rank reports, per mode: its micro-batch count, per-sample
log-probabilities and the step loss of the first step, the full gradients of the first
step, and the full parameters at the end.
"""

from __future__ import annotations

from typing import Any

import torch

from lightrft.strategy import get_strategy
from lightrft.strategy.packing import build_batch, token_logprobs
from lightrft.testing.models import tiny_hf_causal_lm

from .sp_workers import SP_MODEL
from .workers import config

#: Tokens per micro-batch on one rank in the packed modes.
BUDGET = 64
#: Samples per rank per step.
SAMPLES = 6


def step_samples(rank: int, step: int) -> tuple[list[tuple[list[int], list[int]]], torch.Tensor]:
    """This rank's samples of ``step`` and their advantages: rank 0's completions are
    2-8 tokens, rank 1's 16-40 (one of them longer than :data:`BUDGET` with its
    prompt, so it runs alone)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    samples = []
    for i in range(SAMPLES):
        prompt = torch.randint(1, 128, (3 + i % 3,), generator=generator).tolist()
        size = (2, 8) if rank == 0 else (16, 40)
        if rank == 1 and i == 0:
            size = (62, 63)  # prompt + completion over the budget
        count = int(torch.randint(*size, (1,), generator=generator))
        samples.append((prompt, torch.randint(1, 128, (count,), generator=generator).tolist()))
    advantages = torch.randn(SAMPLES, generator=generator)
    return samples, advantages


MODES: dict[str, dict[str, Any]] = {
    "padded": {},
    "packed": {"packing_samples": True, "max_tokens_per_gpu": BUDGET},
    "packed_sp2": {"packing_samples": True, "max_tokens_per_gpu": BUDGET, "sp_size": 2},
    "packed_seq_mean": {
        "packing_samples": True,
        "max_tokens_per_gpu": BUDGET,
        "loss_agg_mode": "seq-mean-token-mean",
    },
}


def reference_step(world_size: int) -> dict[str, Any]:
    """The first step's loss and gradients by the definitions, in one process with no
    strategy: every rank's samples, one at a time, unpadded; ``token-mean`` and
    ``seq-mean-token-mean``."""
    torch.manual_seed(0)
    model = tiny_hf_causal_lm(attn_implementation="sdpa", **SP_MODEL)
    token_terms, sample_terms = [], []
    for rank in range(world_size):
        samples, advantages = step_samples(rank, 0)
        for i in range(len(samples)):
            batch = build_batch(samples, [i], packed=False)
            logp, _ = token_logprobs(model, batch)
            token_terms.append(-advantages[i] * logp)
            sample_terms.append((-advantages[i] * logp).mean())
    out: dict[str, Any] = {}
    for name, loss in (
        ("token-mean", torch.cat(token_terms).sum() / sum(t.numel() for t in token_terms)),
        ("seq-mean-token-mean", torch.stack(sample_terms).mean()),
    ):
        model.zero_grad()
        loss.backward(retain_graph=True)
        out[name] = {
            "loss": float(loss),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
    return out


def train_case(cfg_changes: dict[str, Any], modes: list[str], steps: int = 3) -> dict[str, Any]:
    """Train ``steps`` steps in each mode (one strategy each, closed after); report
    what the module docstring lists."""
    out: dict[str, Any] = {"reference": reference_step(int(torch.distributed.get_world_size()))}
    for mode in modes:
        strategy = get_strategy(config(**{**cfg_changes, **MODES[mode]}))
        rank = strategy.get_rank()
        torch.manual_seed(0)
        model = tiny_hf_causal_lm(attn_implementation="sdpa", **SP_MODEL)
        (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
            model, None, None, None, None, max_steps=10
        )
        lm_head_tokens: list[int] = []
        head = strategy.unwrap_model(actor).lm_head
        head.register_forward_pre_hook(
            lambda _m, args, seen=lm_head_tokens: seen.append(args[0].shape[1])
        )
        record: dict[str, Any] = {"counts": [], "batches": []}
        for step in range(steps):
            samples, advantages = step_samples(rank, step)
            lengths = [len(p) + len(c) for p, c in samples]
            plan = strategy.plan_micro_batches(lengths, [len(c) for _, c in samples])
            record["counts"].append(plan.num_micro_batches)
            logps: dict[int, torch.Tensor] = {}
            step_loss = 0.0
            with plan:
                for index, part in enumerate(plan.micro_batches):
                    batch = build_batch(samples, part, plan.packed).to(strategy.device)
                    record["batches"].append((batch.num_tokens, len(part)))
                    logp, _ = token_logprobs(actor, batch)
                    for sample, values in zip(batch.samples, batch.split(logp), strict=True):
                        logps[sample] = values.detach().clone()
                    adv = batch.per_token(advantages.to(logp.device))
                    loss = plan.loss(-adv * logp, batch)
                    step_loss += float(loss.detach()) / plan.num_micro_batches
                    strategy.backward(loss, actor, optim)
                    last = index == plan.num_micro_batches - 1
                    if step == 0 and last:
                        record["grads"] = strategy.full_gradients(actor)
                    stepped = strategy.optimizer_step(optim, actor, sched)
                    assert stepped == last, (index, stepped)
            if step == 0:
                record["logps"] = [logps[i] for i in range(len(samples))]
                record["loss"] = float(strategy.all_reduce(torch.tensor(step_loss)))
        record["lm_head_tokens"] = lm_head_tokens[: record["counts"][0]]
        record["global_steps"] = strategy.step_state(actor).global_steps
        record["params"] = {
            k: v.detach().clone() for k, v in strategy.full_state_dict(actor).items()
        }
        out[mode] = record
        strategy.close()
    return out
