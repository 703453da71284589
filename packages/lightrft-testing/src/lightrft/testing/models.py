"""Tiny models and token-id tasks for tests and benchmarks: no tokenizer, no download.

``TinyCausalLM`` is plain torch (a pre-norm transformer with a ``layers``
``nn.ModuleList`` and ``_no_split_modules``, so FSDP2 shards it per block);
``tiny_hf_causal_lm`` builds a randomly initialised Hugging Face model from a config
when transformers is installed (for HF-export and engine tests).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch
from torch import nn


class TinyBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyCausalLM(nn.Module):
    """A causal language model over token ids: ``forward(input_ids) -> logits``."""

    _no_split_modules: ClassVar[list[str]] = ["TinyBlock"]

    def __init__(
        self, vocab_size: int = 64, dim: int = 32, layers: int = 2, heads: int = 2,
        max_len: int = 64,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList([TinyBlock(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy."""
        logits = self(input_ids[:, :-1])
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
        )


def copy_task(samples: int, length: int = 8, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    """Token-id sequences whose second half repeats the first: learnable in a few
    hundred steps by :class:`TinyCausalLM`. Shape ``(samples, length)``."""
    if length < 2 or length % 2:
        raise ValueError(f"copy_task length={length} must be an even number >= 2")
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(0, vocab_size, (samples, length // 2), generator=gen)
    return torch.cat([half, half], dim=1)


def tiny_hf_causal_lm(**overrides: Any) -> nn.Module:
    """A randomly initialised Qwen2 causal LM (2 layers, hidden 64, vocab 128) built from
    its config; ``overrides`` change config fields. Needs transformers."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError("tiny_hf_causal_lm needs transformers: pip install transformers") from exc
    fields: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "tie_word_embeddings": True,
    }  # fmt: skip
    fields.update(overrides)
    model: nn.Module = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    return model
