"""Tiny models and tasks for tests, examples and downstream test suites: no tokenizer,
no download, seconds on a CPU.

* :class:`TinyRegressor` with :class:`RegressionTask`: residual MLP blocks on vectors,
  the model of the strategy tests and the conformance suite (exact fp32 references).
* :class:`TinyCausalLM` with :func:`copy_task`: a causal transformer over token ids.
* :func:`tiny_qwen2_config` / :func:`tiny_hf_causal_lm`: a randomly initialised
  Hugging Face Qwen2 built from a config when transformers is installed (HF export,
  engine and weight-sync tests).
* :func:`save_tiny_chat_model`: a tiny instruct-format model directory, tokenizer with
  a ChatML template included, as a user's pretrained chat model comes.

Every model keeps its blocks in an ``nn.ModuleList`` named ``layers`` and names the
block class in ``_no_split_modules``, so FSDP2 shards it block by block.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset


class ResidualMLP(nn.Module):
    """``x + down(gelu(up(norm(x))))``, with optional dropout on the residual branch."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))
        return out


class TinyRegressor(nn.Module):
    """``blocks`` residual MLP blocks and a linear head: ``(batch, dim) -> (batch, outputs)``.

    It has matrices (weight-decayed), biases and norm weights (not decayed), so the
    optimizer's two parameter groups are both exercised.
    """

    _no_split_modules: ClassVar[list[str]] = ["ResidualMLP"]

    def __init__(
        self, dim: int = 16, outputs: int = 4, blocks: int = 3, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ResidualMLP(dim, dropout) for _ in range(blocks)])
        self.head = nn.Linear(dim, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


class RegressionTask(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``size`` samples ``(index, x, y)`` with ``y`` a noisy linear function of ``x``;
    the index lets a test see which samples each rank drew. ``x`` and ``y`` hold the
    whole set, for single-process references."""

    def __init__(self, size: int = 128, dim: int = 16, outputs: int = 4, seed: int = 1234) -> None:
        if outputs > dim:
            raise ValueError(f"RegressionTask outputs={outputs} must be <= dim={dim}")
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=gen)
        self.y = self.x[:, :outputs] * 3.0 + 0.1 * torch.randn(size, outputs, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


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


#: The tiny Qwen2's config fields (2 layers, hidden 64, vocabulary 128, tied embeddings).
TINY_QWEN2: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip


#: Overrides for engine tests: head_dim 64 (hidden 128 / 2 heads; vLLM's CPU attention
#: kernels reject smaller heads) and no eos/bos, so generation runs to max_new_tokens
#: unless stop_token_ids say otherwise.
ENGINE_QWEN2: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 128,
    "eos_token_id": None, "bos_token_id": None,
}  # fmt: skip


def _transformers(what: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(f"{what} needs transformers: pip install transformers") from exc


def tiny_qwen2_config(**overrides: Any) -> Any:
    """A ``transformers.Qwen2Config`` of :data:`TINY_QWEN2` with ``overrides`` applied
    (for engines that build the model themselves from a saved directory)."""
    return _transformers("tiny_qwen2_config").Qwen2Config(**{**TINY_QWEN2, **overrides})


def tiny_hf_causal_lm(**overrides: Any) -> nn.Module:
    """A randomly initialised ``Qwen2ForCausalLM`` of :func:`tiny_qwen2_config`
    (``overrides`` change config fields). Needs transformers."""
    config = tiny_qwen2_config(**overrides)
    model: nn.Module = _transformers("tiny_hf_causal_lm").Qwen2ForCausalLM(config)
    return model


def greedy_reference(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' own ``generate`` of a causal LM, greedy, prompt by prompt (no padding,
    no stop token), on the model's device: the outputs an engine's greedy generation is
    checked against."""
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([list(prompt)], device=model.device),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def save_tiny_qwen2(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random :func:`tiny_hf_causal_lm` (``torch.manual_seed(seed)``; engine-ready
    :data:`ENGINE_QWEN2` sizes, then ``overrides``) with ``save_pretrained`` to ``path``,
    as an engine loads a model: returns the directory."""
    torch.manual_seed(seed)
    model = tiny_hf_causal_lm(**{**ENGINE_QWEN2, **overrides})
    model.save_pretrained(str(path))  # type: ignore[operator]
    return Path(path)


#: A ChatML template, as SmolLM2's and Qwen2's instruct models use.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The chat model's special tokens, after its printable characters and newline.
CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<pad>")


def save_tiny_chat_model(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny chat model as a pretrained instruct model comes: a character-level
    fast tokenizer with ChatML's special tokens and :data:`CHATML` template (eos
    ``<|im_end|>``, as instruct models end a turn; pad ``<pad>``) and a random two-layer
    Qwen2 (``torch.manual_seed(seed)``) over its 99 ids. Needs transformers (and
    tokenizers, which it installs). Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = _transformers("save_tiny_chat_model")
    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate([*characters, *CHAT_SPECIAL_TOKENS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(seed)
    config = hf.Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<pad>"], bos_token_id=None,
    )  # fmt: skip
    hf.Qwen2ForCausalLM(config).save_pretrained(str(path))
    return Path(path)


#: The tiny Qwen2-VL (a vision-language model): the text side of :data:`ENGINE_QWEN2`
#: with a vocabulary of 512 (ids 500-503 are its image, video, vision-start and
#: vision-end tokens), a one-block vision tower with 14-pixel patches merged 2x2, and an
#: image processor that resizes every image to 56x56 pixels (16 patches, 4 tokens).
TINY_QWEN2_VL: dict[str, Any] = {
    "text_config": {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 256, "eos_token_id": None, "bos_token_id": None,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    },
    "vision_config": {
        "depth": 1, "embed_dim": 64, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3,
    },
    "image_token_id": 500, "video_token_id": 501,
    "vision_start_token_id": 502, "vision_end_token_id": 503,
}  # fmt: skip


def save_tiny_qwen2_vl(path: str | Path, seed: int = 0) -> Path:
    """Save a random Qwen2-VL of :data:`TINY_QWEN2_VL` and its image processor to
    ``path`` (no download): returns the directory. Needs transformers and torchvision."""
    transformers = _transformers("save_tiny_qwen2_vl")
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(
        transformers.Qwen2VLConfig(**TINY_QWEN2_VL)
    )
    model.save_pretrained(str(path))
    processor = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    processor.save_pretrained(str(path))
    return Path(path)
