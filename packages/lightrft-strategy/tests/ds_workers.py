"""Rank functions for the DeepSpeed tests (importable by the launcher's processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightrft.strategy import get_strategy

from .workers import RegressionTask, TinyRegressor, config, tiny_hf_causal_lm, train_tiny_hf


def ds(stage: int, **changes: Any) -> dict[str, Any]:
    return config(backend="deepspeed", zero_stage=stage, **changes)


def prepare_case(stage: int) -> dict[str, Any]:
    """prepare / prepare_models_and_optimizers shapes, the engines' configs (with a
    user overlay), unwrap_model, and a step through the critic."""
    from deepspeed import DeepSpeedEngine

    overlay = {"zero_optimization": {"reduce_bucket_size": 123456}, "gradient_clipping": 0.3}
    strategy = get_strategy(ds(stage, deepspeed_config=overlay))
    with strategy.init_model_context():
        actor, critic, rm1, rm2, initial = (TinyRegressor() for _ in range(5))
    (a, a_opt, a_sched), (c, c_opt, c_sched), rewards, ref = strategy.prepare_models_and_optimizers(
        actor, critic, [rm1, rm2], initial, max_steps=4
    )
    single = strategy.prepare(TinyRegressor())
    batches = iter(strategy.setup_dataloader(RegressionTask()))
    stepped = []
    for _ in range(strategy.accumulated_gradient):
        _, x, y = next(batches)
        strategy.backward(nn.functional.mse_loss(c(x), y), c, c_opt)
        stepped.append(strategy.optimizer_step(c_opt, c, c_sched, name="critic"))
    with torch.no_grad():
        ref_out = ref(torch.zeros(2, 16))
    facts = {
        "engines": [isinstance(m, DeepSpeedEngine) for m in (a, c, *rewards, ref, single)],
        "eval_mode": [not strategy.unwrap_model(m).training for m in (*rewards, ref, single)],
        "unwrapped": type(strategy.unwrap_model(a)).__name__,
        "train_stage": a.zero_optimization_stage(),
        "eval_stage": ref.zero_optimization_stage(),
        "bucket": a.zero_reduce_bucket_size(),
        "clipping": a.gradient_clipping(),
        "gas": a.gradient_accumulation_steps(),
        "train_batch": a.train_batch_size(),
        "sched_is_engines": a.lr_scheduler is a_sched,
        "stepped": stepped,
        "critic_steps": strategy.step_state(c).global_steps,
        "actor_steps": strategy.step_state(a).global_steps,
        "ref_out_shape": tuple(ref_out.shape),
        "train_config": strategy.get_ds_train_config(),
        "eval_config": strategy.get_ds_eval_config(offload=True),
        "a_opt_type": type(a_opt).__name__,
        "ckpt_engine": type(a.checkpoint_engine).__name__,
    }
    strategy.close()
    return facts


def save_model_case(out_dir: str, stage: int) -> dict[str, Any]:
    """Build a tiny HF model in init_model_context (partitioned at ZeRO-3), train one
    step, save_model, and return the engine's logits."""
    strategy = get_strategy(ds(stage, train_batch_size=2, micro_train_batch_size=1))
    with strategy.init_model_context():
        model = tiny_hf_causal_lm()
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, 10
    )
    ids = torch.arange(16).reshape(1, 16) % 128
    loss = actor(input_ids=ids, labels=ids).loss
    strategy.backward(loss, actor, optim)
    stepped = strategy.optimizer_step(optim, actor, None)
    strategy.save_model(actor, None, out_dir)
    actor.eval()
    with torch.no_grad():
        logits = actor(input_ids=ids).logits
    strategy.close()
    return {"logits": logits, "stepped": stepped, "partitioned": partitioned}


def nonfinite_case(stage: int, precision: str) -> dict[str, Any]:
    """A step whose gradients hold a NaN is skipped (parameters, optimizer and LR
    untouched); the next finite step is applied."""
    strategy = get_strategy(
        ds(stage, precision=precision, train_batch_size=4, lr_scheduler="linear")
    )
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    x, y = torch.randn(2, 16), torch.randn(2, 4)
    before = {k: v.clone() for k, v in strategy.full_state_dict(actor).items()}
    lr_before = sched.get_last_lr()[0]
    loss = nn.functional.mse_loss(actor(x), y) * (float("nan") if strategy.is_rank_0() else 1.0)
    strategy.backward(loss, actor, optim)
    skipped = not strategy.optimizer_step(optim, actor, sched)
    after_skip = strategy.full_state_dict(actor)
    lr_after_skip = sched.get_last_lr()[0]
    strategy.backward(nn.functional.mse_loss(actor(x), y), actor, optim)
    applied = strategy.optimizer_step(optim, actor, sched)
    after_step = strategy.full_state_dict(actor)
    state = strategy.step_state(actor)
    result = {
        "skipped": skipped,
        "applied": applied,
        "unchanged": all(torch.equal(before[k], after_skip[k]) for k in before)
        if strategy.is_rank_0()
        else None,
        "changed": any(not torch.equal(before[k], after_step[k]) for k in before)
        if strategy.is_rank_0()
        else None,
        "finite": all(torch.isfinite(v).all().item() for v in after_step.values()),
        "lr": (lr_before, lr_after_skip, sched.get_last_lr()[0]),
        "counters": (state.global_steps, state.skipped_steps, state.micro_steps),
    }
    strategy.close()
    return result


def teardown_case(stage: int, save_dir: str) -> int:
    """One short ZeRO job: build, step, checkpoint, close. Returns the step count."""
    strategy = get_strategy(ds(stage, train_batch_size=4))
    with strategy.init_model_context():
        model = TinyRegressor()
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, 10
    )
    strategy.backward(
        nn.functional.mse_loss(actor(torch.randn(2, 16)), torch.randn(2, 4)), actor, optim
    )
    strategy.optimizer_step(optim, actor, sched)
    strategy.save_ckpt(actor, save_dir, max_num=1)
    steps = strategy.step_state(actor).global_steps
    strategy.close()
    return steps


def load_case(stage: int, load_dir: str) -> str:
    """Try to load ``load_dir`` into a fresh ZeRO-``stage`` actor; return the error."""
    strategy = get_strategy(ds(stage))
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    try:
        strategy.load_ckpt(actor, load_dir)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        strategy.close()
    return "loaded"


def clip_after_load_case(stage: int, load_dir: str, max_norm: float) -> float:
    """Load ``load_dir`` into a ZeRO-``stage`` run configured with ``max_norm``; return
    the gradient clipping DeepSpeed's optimizer then applies."""
    strategy = get_strategy(ds(stage, train_batch_size=4, max_norm=max_norm))
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    strategy.load_ckpt(actor, load_dir)
    clip = float(optim.clip_grad)
    strategy.close()
    return clip


def mixed_precision_state_case(cfg: dict[str, Any], save_dir: str) -> dict[str, Any] | None:
    """Train a tiny HF causal LM 2 steps in bf16 and ``save_ckpt``; return (rank 0) each
    trained parameter's fp32 master weight and Adam moments as DeepSpeed holds them in
    memory (the optimizer wrapper's own objects), and the wrapper's class."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    strategy, actor = train_tiny_hf(cfg)
    strategy.save_ckpt(actor, save_dir)
    wrapper = actor.optimizer
    held: dict[str, dict[str, torch.Tensor]] = {}
    names = {id(p): n for n, p in actor.module.named_parameters()}
    if hasattr(wrapper, "fp32_groups"):  # ZeRO-0: DeepSpeed's unfused FP16 wrapper
        for low, high in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True):
            for p, q in zip(low, high, strict=True):
                state = wrapper.optimizer.state[q]
                held[names[id(p)]] = {"fp32": q.detach().cpu().clone()}
                held[names[id(p)]].update(
                    {k: state[k].cpu().clone() for k in ("exp_avg", "exp_avg_sq")}
                )
    elif hasattr(wrapper, "fp32_groups_flat"):  # ZeRO-0 on CUDA: the fused FP16 wrapper
        for low, flat in zip(wrapper.fp16_groups, wrapper.fp32_groups_flat, strict=True):
            state, offset = wrapper.optimizer.state[flat], 0
            for p in low:
                n = p.numel()
                pieces = {"fp32": flat, **{k: state[k] for k in ("exp_avg", "exp_avg_sq")}}
                held[names[id(p)]] = {
                    k: v.detach().reshape(-1)[offset : offset + n].view(p.shape).cpu().clone()
                    for k, v in pieces.items()
                }
                offset += n
    else:  # ZeRO-1 (the BF16 optimizer): DeepSpeed's own gathering API (collective)
        for name, p in actor.module.named_parameters():
            held[name] = {"fp32": safe_get_full_fp32_param(p).cpu().clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                held[name][key] = safe_get_full_optimizer_state(p, key).cpu().clone()
    out = {"wrapper": type(wrapper).__name__, "held": held}
    rank = strategy.get_rank()
    strategy.close()
    return out if rank == 0 else None


def from_pretrained_after_a_dropped_hf_config_case(model_dir: str) -> dict[str, Any]:
    """ZeRO-3: other code makes an ``HfDeepSpeedConfig`` and drops it (upstream's
    ``ActorLanguage`` does), which leaves transformers' weak reference dead; a
    ``from_pretrained`` in the strategy's ``init_model_context`` must still load into
    the partitions. Reports whether it did and the loaded weights' sum."""
    import transformers
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    strategy = get_strategy(ds(3))
    with strategy.init_model_context():
        transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    HfDeepSpeedConfig(strategy.backend.train_config())  # made and dropped at once
    with strategy.init_model_context():
        enabled = is_deepspeed_zero3_enabled()
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    full = strategy.full_state_dict(strategy.prepare_model(model))
    strategy.close()
    return {"enabled": enabled, "partitioned": partitioned,
            "sum": float(sum(v.double().sum() for v in full.values()))}  # fmt: skip


def jit_ops_case(stage: int) -> dict[str, Any]:
    """Build a strategy, train one step: which DeepSpeed ops the job built (under the
    TORCH_EXTENSIONS_DIR the test gives), and whether DeepSpeed's communication layer
    holds its shared-memory all-reduce op."""
    import deepspeed.comm.comm as ds_comm

    from lightrft.strategy.deepspeed import cpu_ops

    strategy = get_strategy(ds(stage))
    model, optim, sched = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, max_steps=2
    )[0]
    _, x, y = next(iter(strategy.setup_dataloader(RegressionTask())))
    for _ in range(strategy.accumulated_gradient):
        strategy.backward(nn.functional.mse_loss(model(x), y), model, optim)
        strategy.optimizer_step(optim, model, sched)
    facts = {
        "built": cpu_ops.built_ops(),
        "shm_op_loaded": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
    }
    strategy.close()
    return facts
