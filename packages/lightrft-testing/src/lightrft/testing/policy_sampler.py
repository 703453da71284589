"""Completions drawn from a causal LM with plain forward passes: the sampler behind
``FakeEngine(policy=...)``.

No KV cache, no padding, no engine: each new token costs one forward pass over the whole
sequence, so it suits the tiny models of tests and demos. A prompt's ``n`` samples are one
batch; sample ``k`` of request ``i`` (the prompt's position in the call) draws from its
own generator, seeded from ``SamplingParams.seed + i`` and ``k``, as the vLLM and SGLang
adapters seed request ``i`` with ``seed + i``: the same call gives the same completions,
and a prompt repeated within a call gets different ones. Without a seed, the base seed is
drawn from torch's global generator (reproducible under ``torch.manual_seed``, as the HF
engine's sampling).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightrft.engines.protocol import EngineError, GenerationOutput, SamplingParams


def sample_seed(request_seed: int, k: int) -> int:
    """The generator seed of sample ``k`` of a request seeded ``request_seed``."""
    text = f"{request_seed}:{k}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _logits(policy: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """The last position's logits, float32 on the CPU: [rows, vocab]."""
    out = policy(sequences)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits[:, -1].float().cpu()


def _pick(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """One token from one row of logits, and its log-probability under the distribution it
    was drawn from: greedy at temperature 0 (the log-probability at temperature 1, as
    vLLM and SGLang report it), else temperature, top-k and top-p (renormalised over the
    kept tokens), then a draw."""
    if sampling.temperature == 0:
        token = int(logits.argmax())
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scores = logits / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always)
        drop = ordered.cumsum(0) - ordered >= sampling.top_p
        probs = probs.scatter(0, order, ordered.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(probs[token].log())


@torch.no_grad()
def sample_completions(
    policy: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    weight_version: int = 0,
) -> list[GenerationOutput]:
    """``sampling.n`` completions per prompt, in order (prompt 0's samples first)."""
    device = next(policy.parameters()).device
    stops = set(sampling.stop_token_ids)
    base = sampling.seed
    if base is None:
        base = int(torch.randint(0, 2**62, (1,)))
    outputs: list[GenerationOutput] = []
    for request, prompt in enumerate(prompts):
        ids = list(prompt)
        n = sampling.n
        generators = [
            torch.Generator().manual_seed(sample_seed(base + request, k)) for k in range(n)
        ]
        sequences = torch.tensor([ids] * n, device=device)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        for _ in range(sampling.max_new_tokens):
            logits = _logits(policy, sequences)
            step: list[int] = []
            for k in range(n):
                token, logprob = _pick(logits[k], sampling, generators[k])
                step.append(token)
                if not done[k]:
                    tokens[k].append(token)
                    logprobs[k].append(logprob)
                    done[k] = token in stops
            if all(done):
                break
            sequences = torch.cat([sequences, torch.tensor(step, device=device)[:, None]], 1)
        outputs.extend(
            GenerationOutput(
                ids,
                tokens[k],
                "stop" if done[k] else "length",
                logprobs=logprobs[k] if sampling.logprobs else None,
                weight_version=weight_version,
            )
            for k in range(n)
        )
    return outputs


def load_policy(model_path: str, device: str = "cpu") -> Any:
    """A Hugging Face causal LM from a folder, in float32 and eval mode (transformers
    is lightrft-testing's ``hf`` extra), whole even beside a ZeRO-3 strategy."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError(
            f"FakeEngine samples from the model at {model_path!r} with transformers, which is "
            "not installed: pip install 'lightrft-testing[hf]', or pass the engine option "
            "sample_from_model=False for the deterministic output rule"
        ) from exc
    from lightrft.engines.hf import outside_zero3

    try:
        with outside_zero3():  # a full copy, also beside a ZeRO-3 strategy
            model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise EngineError(
            f"FakeEngine could not load {model_path!r} as a causal LM to sample from "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass "
            "the engine option sample_from_model=False for the deterministic output rule"
        ) from exc
    return model.to(device).eval()
