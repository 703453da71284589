"""vLLM sleep levels on CUDA, where vLLM has sleep mode (not its CPU build).

Run by `nox -s gpu` on a machine with a GPU; they fail, not skip, without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 99, 3], [42]]


def _sleep_levels(model_dir: str) -> dict[str, Any]:
    import torch

    from lightrft.engines import EngineError, SamplingParams
    from lightrft.strategy import get_strategy

    assert torch.cuda.is_available(), "the gpu tests need CUDA"
    strategy = get_strategy({"backend": "fsdp2", "device": "cuda", "precision": "bf16",
                             "train_batch_size": 1, "micro_train_batch_size": 1,
                             "enable_engine_sleep": True, "engine_sleep_level": 2,
                             "pretrain": model_dir, "engine_type": "vllm",
                             "engine_mem_util": 0.3, "engine_max_model_len": 128})  # fmt: skip
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    engine = strategy.setup_inference_engine(None, actor=actor)  # built, synced, asleep
    out: dict[str, Any] = {"supports_sleep": engine.supports_sleep, "asleep": engine.state.asleep}
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    free_asleep = torch.cuda.mem_get_info()[0]
    strategy.wakeup_inference_engine(["weights"])
    strategy.update_engine_weights(actor, verify=False)  # level 2: weights were discarded
    strategy.wakeup_inference_engine(["kv_cache"])
    free_awake = torch.cuda.mem_get_info()[0]
    out["freed_mib"] = (free_asleep - free_awake) / 2**20
    first = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)]
    out["verify"] = strategy.verify_engine_weights(actor, tolerance=0.1)["max_logprob_gap"]
    engine.sleep(1)  # level 1 keeps the weights (in CPU memory)
    try:
        engine.generate(PROMPTS, greedy)
    except EngineError as exc:
        out["asleep_error"] = str(exc)
    engine.wake_up()
    out["level1_same"] = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)] == first
    engine.sleep(2)
    engine.wake_up(["weights"])
    try:
        engine.generate(PROMPTS, greedy)
    except EngineError as exc:
        out["stale_error"] = str(exc)
    strategy.update_engine_weights(actor)
    engine.wake_up(["kv_cache"])
    out["level2_same"] = [o.output_token_ids for o in engine.generate(PROMPTS, greedy)] == first
    engine.shutdown()
    strategy.close()
    return out


def test_vllm_sleep_levels_release_memory_and_refuse_stale_weights(tmp_path: Path) -> None:
    from lightrft.testing.models import save_tiny_qwen2

    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    r = run_distributed(_sleep_levels, 1, model_dir, init_process_group=False, timeout=600)[0]
    assert r["supports_sleep"] and r["asleep"]
    assert r["freed_mib"] > 0, "waking took no GPU memory back: sleep released nothing"
    assert r["verify"] < 0.1
    assert "asleep" in r["asleep_error"] and "stale weights" in r["stale_error"]
    assert r["level1_same"] and r["level2_same"]
