"""Rank functions of the LoRA tests (:mod:`tests.test_lora`): a peft LoRA adapter on a
tiny Qwen2, trained through a strategy, synced merged into the Hugging Face engine and
saved as an adapter and as a merged model."""

from __future__ import annotations

from typing import Any

import torch

from lightrft.strategy import get_strategy
from lightrft.strategy.lora import apply_lora
from lightrft.testing.models import tiny_hf_causal_lm

#: The adapter every test trains: rank 4 on three of Qwen2's linear modules.
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
PROBE = [[5, 17, 99, 3, 42, 7], [11, 12, 13]]


def config(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "backend": "fsdp2", "device": "cpu", "bf16": False, "seed": 0,
        "train_batch_size": 4, "micro_train_batch_size": 1, "max_norm": 1.0,
        "actor_learning_rate": 1e-2, "lr_warmup_ratio": 0.0,
        "lr_scheduler": "constant_with_warmup", "l2": 0.0,
    }  # fmt: skip
    base.update(changes)
    return base


def build(strategy: Any, seed: int) -> Any:
    """The tiny Qwen2 with its adapter, built in the strategy's init context."""
    torch.manual_seed(seed)
    with strategy.init_model_context():
        return apply_lora(tiny_hf_causal_lm(), **LORA)


def batches(rank: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (1, 10), generator=generator) for _ in range(count)]


def lora_step_case(cfg: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    """Prepare the LoRA model, train ``steps`` optimizer steps on rank-specific batches,
    and return the full state before and after, the trainable names and the probe's
    logits at the start (rank 0's full tensors)."""
    strategy = get_strategy(cfg)
    model = build(strategy, cfg["seed"])
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    optim = strategy.create_optimizer(model)
    in_optimizer = sum(len(g["params"]) for g in optim.param_groups)
    model, optim, sched = strategy.prepare((model, optim, None))
    start = strategy.full_state_dict(model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROBE[0]])).logits
    used = batches(strategy.get_rank(), steps * strategy.accumulated_gradient)
    stepped = []
    for ids in used:
        strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
        stepped.append(strategy.optimizer_step(optim, model, sched))
    end = strategy.full_state_dict(model)
    strategy.close()
    return {
        "start": start, "end": end, "trainable": trainable, "in_optimizer": in_optimizer,
        "logits": logits, "used": used, "stepped": stepped,
    }  # fmt: skip


def lora_sync_case(cfg: dict[str, Any], model_dir: str, out_dir: str) -> dict[str, Any]:
    """Train the LoRA model (built from the saved base in ``model_dir``), sync it merged
    into the Hugging Face engine three times (the second after one more step: only the
    LoRA layers go; the third after a sleep), generate greedily, save the adapter and
    the merged model and a checkpoint (with the tiny tokenizer) under ``out_dir``."""
    from transformers import AutoModelForCausalLM

    strategy = get_strategy({**cfg, "pretrain": model_dir})
    torch.manual_seed(cfg["seed"])
    with strategy.init_model_context():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = apply_lora(base, **LORA)
    optim = strategy.create_optimizer(model)
    model, optim, sched = strategy.prepare((model, optim, None))
    strategy.setup_inference_engine(None, "hf")
    stats, out = _train_sync_generate(strategy, model, optim, sched)
    full = strategy.full_state_dict(model)
    strategy.save_model(model, None, f"{out_dir}/adapter")
    strategy.save_model(model, None, f"{out_dir}/merged", merge_lora=True)
    from tests.workers import tiny_tokenizer

    strategy.save_ckpt(model, f"{out_dir}/ckpt", tokenizer=tiny_tokenizer())
    strategy.close()
    return {
        "generated": [o.output_token_ids for o in out],
        "stats": stats,
        "full": full,
    }


def lora_resume_case(cfg: dict[str, Any], save_dir: str, resume: bool) -> dict[str, Any]:
    """Two optimizer steps of the LoRA model with a checkpoint after the first; with
    ``resume``, a fresh model loads that checkpoint and takes the second step only.
    Returns the full state after the second step."""
    strategy = get_strategy(cfg)
    model = build(strategy, cfg["seed"] + (7 if resume else 0))  # resume: other start
    optim = strategy.create_optimizer(model)
    sched = strategy.create_scheduler(optim, max_steps=10)
    model, optim, sched = strategy.prepare((model, optim, sched))
    acc = strategy.accumulated_gradient
    used = batches(strategy.get_rank(), 2 * acc)
    if resume:
        strategy.load_ckpt(model, save_dir)
    else:
        for ids in used[:acc]:
            strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
            strategy.optimizer_step(optim, model, sched)
        strategy.save_ckpt(model, save_dir)
    for ids in used[acc:]:
        strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
        strategy.optimizer_step(optim, model, sched)
    state = strategy.full_state_dict(model)
    steps = strategy.step_state(model).global_steps
    strategy.close()
    return {"state": state, "steps": steps}


def lora_adapter_sync_case(cfg: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """Train the LoRA model and sync its adapter alone (``lora_sync="adapter"``) into a
    fake engine that serves adapters and samples from the saved base model, twice (one
    more step between); generate greedily; then the refusals: an engine without
    adapters, and an adapter whose names are not the engine's model's."""
    from lightrft.strategy.lora import LoraError
    from lightrft.testing.fake_engine import FakeEngine

    strategy = get_strategy({**cfg, "pretrain": model_dir, "lora_sync": "adapter", "lora_rank": 4,
                             "engine_options": {"serves_adapters": True}})  # fmt: skip
    model = _from_saved_base(strategy, model_dir, cfg["seed"])
    optim = strategy.create_optimizer(model)
    model, optim, sched = strategy.prepare((model, optim, None))
    strategy.setup_inference_engine(None, "fake")
    engine = strategy.inference_engine
    stats, out = _train_sync_generate(strategy, model, optim, sched)
    errors = {}
    for ids in batches(strategy.get_rank() + 20, strategy.accumulated_gradient):
        strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
        strategy.optimizer_step(optim, model, sched)
    try:  # trained since the last sync: the engine's adapter is not the trainer's
        strategy.verify_engine_weights(model)
    except Exception as exc:
        errors["unsynced"] = f"{type(exc).__name__}: {exc}"
    try:
        strategy.update_engine_weights(model, name_map=lambda name: f"other.{name}")
    except LoraError as exc:
        errors["names"] = str(exc)
    held = dict(engine.adapter)
    strategy.engine_link.attach(FakeEngine(vocab_size=128))
    try:
        strategy.update_engine_weights(model)
    except LoraError as exc:
        errors["no_adapters"] = str(exc)
    full = strategy.full_state_dict(model)
    strategy.close()
    return {
        "generated": [o.output_token_ids for o in out],
        "stats": stats,
        "full": full,
        "held": sorted(held),
        "settings": engine.adapter_settings,
        "errors": errors,
    }


def _from_saved_base(strategy: Any, model_dir: str, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with strategy.init_model_context():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return apply_lora(base, **LORA)


def _train_sync_generate(
    strategy: Any, model: Any, optim: Any, sched: Any
) -> tuple[list[Any], Any]:
    """Three rounds of (a step on rank-specific batches, a verified sync), the engine put
    to sleep (at the config's level, if any) before the third, then greedy generation
    of this rank's probe: (the syncs' stats, the outputs)."""
    from lightrft.engines import SamplingParams

    rank = strategy.get_rank()
    stats = []
    for step in range(3):
        if step == 2:
            strategy.maybe_sleep_inference_engine()
        for ids in batches(rank + 10 * step, strategy.accumulated_gradient):
            strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
            strategy.optimizer_step(optim, model, sched)
        stats.append(strategy.update_engine_weights(model, verify=True))
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    return stats, strategy.gather_and_generate([PROBE[rank]], greedy)


def lora_ema_case(cfg: dict[str, Any], beta: float = 0.9) -> dict[str, Any]:
    """moving_average of a prepared LoRA model into a prepared copy after each optimizer
    step, and the same EMA computed on the full states: (EMA state, expected)."""
    strategy = get_strategy(cfg)
    model, ema = build(strategy, cfg["seed"]), build(strategy, cfg["seed"])
    optim = strategy.create_optimizer(model)
    model, optim, sched = strategy.prepare((model, optim, None))
    ema = strategy.prepare_model(ema)
    expected = {k: v.clone() for k, v in strategy.full_state_dict(ema).items()}
    start = dict(expected)
    updates = 0
    for ids in batches(strategy.get_rank(), 2 * strategy.accumulated_gradient):
        strategy.backward(model(input_ids=ids, labels=ids).loss, model, optim)
        if strategy.optimizer_step(optim, model, sched):
            for name, value in strategy.full_state_dict(model).items():
                expected[name] = beta * expected[name] + (1 - beta) * value
        updates += strategy.moving_average(model, ema, beta)  # once per step
    got = strategy.full_state_dict(ema)
    strategy.close()
    return {"ema": got, "expected": expected, "updates": updates, "start": start}
