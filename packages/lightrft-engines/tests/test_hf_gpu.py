"""The Hugging Face engine on CUDA: run by `nox -s gpu-hf` or tools/gpu_offline.py on a
machine with a GPU (deselected elsewhere). It fails, not skips, without CUDA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightrft.engines import EngineError, SamplingParams, build_engine
from lightrft.engines.hf import HFEngine
from lightrft.testing.models import greedy_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7, 7, 7]]  # uneven: left padding is exercised
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def test_hf_engine_on_cuda_generates_as_transformers_and_sleep_frees_its_memory(
    tiny_model_dir: Path,
) -> None:
    assert torch.cuda.is_available(), "the gpu tests need CUDA"
    args = {"engine_type": "hf", "pretrain": str(tiny_model_dir), "bf16": False, "device": "cuda"}
    engine = build_engine(args)
    assert isinstance(engine, HFEngine) and engine.device.type == "cuda"
    first = [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert first == greedy_reference(engine.model, PROMPTS, 8)

    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    awake = torch.cuda.memory_allocated()
    engine.sleep(1)  # level 1: the weights move to CPU memory
    assert awake - torch.cuda.memory_allocated() >= weights, "sleep left the weights on the GPU"
    with pytest.raises(EngineError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up()
    assert next(engine.model.parameters()).device.type == "cuda"
    assert [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)] == first

    # level 2, then a sync of changed weights: the engine serves the new ones
    trained = copy.deepcopy(engine.model)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.05 * torch.randn(param.shape, device="cuda", generator=generator))
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(EngineError, match="stale weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.sleep(2)
    engine.wake_up(["weights"])  # the order a level-2 sleep needs: weights, sync, KV cache
    named = list(trained.named_parameters())
    for start in range(0, len(named), 5):  # in buckets, as the strategy sends them
        engine.update_weights(named[start : start + 5])
    engine.finish_weight_update()
    engine.wake_up(["kv_cache"])
    after = engine.generate(PROMPTS, GREEDY)
    assert [o.output_token_ids for o in after] == greedy_reference(trained, PROMPTS, 8)
    assert [o.output_token_ids for o in after] != first and {o.weight_version for o in after} == {1}
    engine.shutdown()
