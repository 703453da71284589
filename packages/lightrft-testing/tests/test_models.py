"""Tiny model builders: shapes, determinism, a task the model can learn."""

from __future__ import annotations

import pytest
import torch

from lightrft.testing.models import TinyCausalLM, copy_task, tiny_hf_causal_lm


def test_tiny_causal_lm_is_causal_and_shards_per_block() -> None:
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=32, dim=16, layers=2, heads=2)
    ids = torch.randint(0, 32, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 32)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 32
    torch.testing.assert_close(model(changed)[:, :6], logits[:, :6])  # no look-ahead
    assert type(model.layers[0]).__name__ in model._no_split_modules


def test_copy_task_is_deterministic_and_learnable() -> None:
    data = copy_task(64, length=8, vocab_size=16, seed=1)
    assert torch.equal(data, copy_task(64, length=8, vocab_size=16, seed=1))
    assert torch.equal(data[:, :4], data[:, 4:])
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=16, dim=32, layers=2, heads=2)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model.loss(data).item()
    for _ in range(150):
        loss = model.loss(data)
        optim.zero_grad()
        loss.backward()
        optim.step()
    assert loss.item() < 0.6 * first
    with pytest.raises(ValueError, match="even number"):
        copy_task(4, length=3)


def test_tiny_hf_model_builds_from_a_config_without_downloads() -> None:
    model = tiny_hf_causal_lm(num_hidden_layers=1)
    assert model.config.num_hidden_layers == 1
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)
