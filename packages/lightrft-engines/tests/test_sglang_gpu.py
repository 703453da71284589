"""A real sglang.Engine on CUDA, through the strategy: build, sync, generate, sleep levels.

Run by `nox -s gpu` on a machine with a GPU; they fail, not skip, without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 99, 3], [42]]


def _round_trip(model_dir: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from lightrft.engines import EngineError, SamplingParams
    from lightrft.strategy import get_strategy

    assert torch.cuda.is_available(), "the gpu tests need CUDA"
    strategy = get_strategy({"backend": "fsdp2", "device": "cuda", "precision": "fp32",
                             "train_batch_size": 1, "micro_train_batch_size": 1,
                             "enable_engine_sleep": True, "engine_sleep_level": 2,
                             "pretrain": model_dir, "engine_type": "sglang",
                             "engine_mem_util": 0.3, "engine_max_model_len": 128})  # fmt: skip
    actor: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    engine = strategy.setup_inference_engine(None, actor=actor)  # built, synced, asleep
    out: dict[str, Any] = {"engine": type(engine).__name__, "asleep": engine.state.asleep}
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    free_asleep = torch.cuda.mem_get_info()[0]
    strategy.wakeup_inference_engine(["weights"])
    strategy.update_engine_weights(actor)  # level 2 released the weights
    strategy.wakeup_inference_engine(["kv_cache"])
    out["freed_mib"] = (free_asleep - torch.cuda.mem_get_info()[0]) / 2**20
    before = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)]
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(0.05 * torch.randn(param.shape, device="cuda", generator=generator))
    strategy.update_engine_weights(actor)
    out["gap"] = strategy.verify_engine_weights(actor, tolerance=0.05)["max_logprob_gap"]
    after = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)]
    out["changed"] = after != before
    reference = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = actor.generate(input_ids=torch.tensor([prompt], device="cuda"),
                                 max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)  # fmt: skip
        reference.append(ids[0, len(prompt) :].tolist())
    out["equal_to_transformers"] = after == reference
    engine.sleep(2)
    engine.wake_up(["weights"])
    try:
        engine.generate(PROMPTS, greedy)
    except EngineError as exc:
        out["stale_error"] = str(exc)
    strategy.update_engine_weights(actor)
    engine.wake_up(["kv_cache"])
    out["after_level2"] = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)] == after
    strategy.close()
    return out


def test_sglang_generates_from_the_synced_weights_and_sleeps(tmp_path: Path) -> None:
    from lightrft.testing.models import save_tiny_qwen2

    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    r = run_distributed(_round_trip, 1, model_dir, init_process_group=False, timeout=800)[0]
    assert r["engine"] == "SGLangEngine" and r["asleep"]
    assert r["freed_mib"] > 0, "waking took no GPU memory back: sleep released nothing"
    assert r["changed"] and r["equal_to_transformers"]
    assert r["gap"] < 0.05
    assert "stale weights" in r["stale_error"] and r["after_level2"]
