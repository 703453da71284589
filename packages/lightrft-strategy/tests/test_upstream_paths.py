"""Upstream LightRFT's import paths and the names kept for older callers: each one
imports and is the object it stands for; a removed name says what replaced it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from lightrft.strategy.fsdp2 import FSDP2Strategy


def test_upstreams_strategy_module_is_the_registry_and_engine_link() -> None:
    from lightrft.strategy import engine_link, registry, strategy

    assert strategy.get_strategy is registry.get_strategy
    assert strategy.is_engine is engine_link.is_engine


def test_upstreams_fsdpv2_path_is_the_fsdp2_backend() -> None:
    from lightrft.strategy.fsdp.fsdpv2 import FSDPV2Strategy

    assert FSDPV2Strategy is FSDP2Strategy


@pytest.mark.deepspeed
def test_upstreams_deepspeed_path_is_the_deepspeed_backend() -> None:
    from lightrft.strategy.deepspeed import strategy as ours
    from lightrft.strategy.deepspeed.deepspeed import DeepspeedStrategy

    assert DeepspeedStrategy is ours.DeepspeedStrategy


def test_rollouts_names_stay_and_a_removed_one_names_its_replacement() -> None:
    rollout = importlib.import_module("lightrft.strategy.rollout")
    from lightrft.strategy import engine_link

    for name in rollout.__all__:
        assert getattr(rollout, name) is getattr(engine_link, name), name
    with pytest.raises(ImportError, match=r"InferenceEngineCalls.*EngineLink"):
        from lightrft.strategy.rollout import InferenceEngineCalls  # noqa: F401


def test_ulysses_applied_then_removed_leaves_the_model_as_it_was(
    single: Callable[..., FSDP2Strategy],
) -> None:
    """Over a group of one rank (nothing split): applied, the model computes as before
    through Ulysses' hooks; removed, its attention and hooks are the original ones."""
    from lightrft.strategy import ulysses
    from lightrft.testing.models import tiny_hf_causal_lm

    single()  # the process group of one
    torch.manual_seed(0)
    model = tiny_hf_causal_lm().eval()
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        before = model(input_ids=ids).logits
    decoder = ulysses.decoder_of(model)
    inner = decoder.config._attn_implementation
    assert not ulysses.is_applied(model)
    ulysses.apply_ulysses(model, dist.group.WORLD)
    assert ulysses.is_applied(model) and decoder.config._attn_implementation != inner
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    ulysses.remove_ulysses(model)
    assert not ulysses.is_applied(model)
    assert decoder.config._attn_implementation == inner
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
