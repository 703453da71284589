"""Shared fixtures: a tiny random Qwen2 saved as a Hugging Face directory (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

#: head_dim 64 (hidden 128 / 2 heads): vLLM's CPU attention kernels reject smaller heads.
#: No eos/bos: generation runs to max_new_tokens unless stop_token_ids say otherwise.
QWEN2 = {
    "vocab_size": 128, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 128, "eos_token_id": None, "bos_token_id": None,
}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 (seed 0) saved with save_pretrained, fp32."""
    import torch

    from lightrft.testing.models import tiny_hf_causal_lm

    torch.manual_seed(0)
    model = tiny_hf_causal_lm(**QWEN2)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    return path
