"""Rank functions of the jobs with engine ranks of their own (test_engine_ranks.py):
the first ranks train a tiny Hugging Face causal LM, the last ones serve the HF engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

from lightrft.strategy import get_strategy

from .workers import config

PROMPTS = {0: [[1, 2, 3], [4, 5]], 1: [[6, 7, 8, 9]]}


def separate_config(model_dir: str, **changes: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "engine_placement": "separate",
        "engine_type": "hf",
        "pretrain": model_dir,
        "train_batch_size": 4,
        "micro_train_batch_size": 2,
    }
    return config(**{**settings, **changes})


def _trainer(cfg: dict[str, Any], model_dir: str) -> tuple[Any, Any, Any, Any] | dict[str, Any]:
    """The strategy, actor, optimizer and scheduler on a trainer rank; on an engine rank
    what ``get_strategy`` exited with once the trainers closed."""
    from transformers import AutoModelForCausalLM

    try:
        strategy = get_strategy(cfg)
    except SystemExit as exc:  # an engine rank: it served until the trainers closed
        return {"engine_rank_exit": exc.code}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=10
    )
    strategy.setup_inference_engine(strategy.config, actor=actor)
    return strategy, actor, optim, sched


def _train(strategy: Any, actor: Any, optim: Any, sched: Any, steps: int) -> list[float]:
    losses = []
    generator = torch.Generator().manual_seed(100 + strategy.get_rank())
    for _ in range(steps * strategy.accumulated_gradient):
        ids = torch.randint(0, 100, (1, 10), generator=generator)
        loss = actor(input_ids=ids, labels=ids).loss
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)
        losses.append(float(loss.detach()))
    return losses


def sync_and_generate_case(cfg: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """Generate before and after two training steps and a verified sync."""
    from lightrft.engines import SamplingParams

    made = _trainer(cfg, model_dir)
    if isinstance(made, dict):
        return made
    strategy, actor, optim, sched = made
    rank = strategy.get_rank()
    sampling = SamplingParams(max_new_tokens=4, n=2, seed=3, temperature=1.0, logprobs=True)
    before = strategy.gather_and_generate(PROMPTS[rank], sampling)
    verified_before = strategy.verify_engine_weights(actor)
    losses = _train(strategy, actor, optim, sched, steps=2)
    stats = strategy.update_engine_weights(actor, verify=True)
    after = strategy.gather_and_generate(PROMPTS[rank], sampling)
    empty = strategy.gather_and_generate([] if rank else PROMPTS[0], sampling)
    errors = {}
    for label, bad in (("vocab", [[1, 5000]]), ("empty", [[]])):
        try:
            strategy.gather_and_generate(bad if rank == 1 else PROMPTS[0], sampling)
        except Exception as exc:  # every trainer rank raises the same error
            errors[label] = f"{type(exc).__name__}: {exc}"
    state = strategy.full_state_dict(actor)
    result = {
        "world_size": strategy.world_size,
        "accumulated_gradient": strategy.accumulated_gradient,
        "before": [(o.output_token_ids, o.logprobs, o.weight_version) for o in before],
        "after": [(o.output_token_ids, o.weight_version) for o in after],
        "empty": len(empty),
        "verified_before": verified_before["max_logprob_gap"],
        "sync": {k: stats[k] for k in ("tensors", "buckets", "weight_version", "max_logprob_gap")},
        "losses": losses,
        "params": len(list(strategy.unwrap_model(actor).named_parameters())),
        "errors": errors,
        "state": {k: v.clone() for k, v in state.items()} if rank == 0 else None,
    }
    strategy.close()
    return result


def lost_engine_case(cfg: dict[str, Any], model_dir: str, out: str) -> dict[str, Any]:
    """Trainer rank 0 kills the engine rank after one generation; the next generation
    must name it on every trainer rank (written to ``out``/rank<r>.txt, since the job
    then fails with the killed rank)."""
    from lightrft.engines import SamplingParams
    from lightrft.strategy import distributed

    made = _trainer(cfg, model_dir)
    if isinstance(made, dict):
        return made
    strategy, *_ = made
    rank = strategy.get_rank()
    sampling = SamplingParams(max_new_tokens=2, seed=1)
    strategy.gather_and_generate(PROMPTS[rank], sampling)
    if rank == 0:
        store = distributed.group_store("engine-hosts/")
        assert store is not None
        pid = int(store.get("2").decode().split()[1])
        os.kill(pid, signal.SIGKILL)
    try:
        strategy.gather_and_generate(PROMPTS[rank], sampling)
        message = "no error"
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(message)
    return {"message": message}


def staleness_case(
    cfg: dict[str, Any], model_dir: str, steps: int, checkpoint: str | None = None
) -> dict[str, Any]:
    """A loop written once for every placement: sync, collect this step's rollouts
    (submitted during the last step), submit the next step's, train on this step's
    completions. Returns per step the rollouts, their weight versions and lag, the
    loss, and rank 0's final parameters. With ``checkpoint`` (a directory), step 2
    ends with a save (the last step's rollouts in flight); after the loop, with other
    prompts in flight, the run loads it and redoes the last step ("resumed")."""
    from lightrft.engines import SamplingParams

    made = _trainer(cfg, model_dir)
    if isinstance(made, dict):
        return made
    strategy, actor, optim, sched = made
    rank = strategy.get_rank()

    def prompts(step: int) -> list[list[int]]:
        return [[(7 * step + 3 * rank + j) % 90 + 1 for j in range(3)] for _ in range(2)]

    def sampling(step: int) -> Any:
        return SamplingParams(max_new_tokens=3, n=2, seed=10 + step, temperature=1.0, logprobs=True)

    record: dict[str, list[Any]] = {
        "tokens": [], "logprobs": [], "versions": [], "lag": [], "loss": []
    }  # fmt: skip
    for step in range(1, steps + 1):
        strategy.update_engine_weights(actor, skip_unchanged=True)
        if step == 1:
            strategy.submit_generation(prompts(step), sampling(step))
        outputs = strategy.collect_generation()
        record["lag"].append(strategy.rollout_lag(outputs))
        if step < steps:
            strategy.submit_generation(prompts(step + 1), sampling(step + 1))
        record["tokens"].append([o.output_token_ids for o in outputs])
        record["versions"].append([o.weight_version for o in outputs])
        record["logprobs"].append([o.logprobs for o in outputs])
        ids = torch.tensor([o.prompt_token_ids + o.output_token_ids for o in outputs])
        loss = actor(input_ids=ids, labels=ids).loss
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)
        record["loss"].append(float(loss.detach()))
        if checkpoint is not None and step == 2:
            strategy.save_ckpt(actor, checkpoint, tag="step2")
    state = strategy.full_state_dict(actor)
    resumed: dict[str, Any] = {}
    if checkpoint is not None:  # as a resumed run: load, sync, submit step 3 again
        strategy.submit_generation(prompts(99), sampling(99))  # dropped by the load
        strategy.load_ckpt(actor, checkpoint)
        strategy.update_engine_weights(actor, skip_unchanged=True)
        strategy.submit_generation(prompts(3), sampling(3))
        outputs = strategy.collect_generation()
        ids = torch.tensor([o.prompt_token_ids + o.output_token_ids for o in outputs])
        loss = actor(input_ids=ids, labels=ids).loss
        resumed = {"tokens": [o.output_token_ids for o in outputs],
                   "lag": strategy.rollout_lag(outputs), "loss": float(loss.detach())}  # fmt: skip
        strategy.submit_generation(prompts(4), sampling(4))  # the engine ranks' next
        resumed["next"] = len(strategy.collect_generation())
    strategy.close()
    return {**record, "resumed": resumed,
            "state": {k: v.clone() for k, v in state.items()} if rank == 0 else None}  # fmt: skip


def adapter_sync_case(cfg: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """A LoRA actor trained on the trainer ranks whose adapter alone is synced to the
    engine rank (``lora_sync="adapter"``; the fake engine there serves adapters and
    samples from the saved base model), three verified rounds, then greedy generation;
    then the engine ranks' engine rebuilt as the HF engine, which serves no adapters."""
    from lightrft.strategy.lora import LoraError

    from .lora_workers import _from_saved_base, _train_sync_generate

    try:
        lora = {"lora_sync": "adapter", "lora_rank": 4}
        options = {"engine_options": {"serves_adapters": True}}
        strategy = get_strategy({**cfg, "pretrain": model_dir, **lora, **options})
    except SystemExit as exc:  # an engine rank: it served until the trainers closed
        return {"engine_rank_exit": exc.code}
    model = _from_saved_base(strategy, model_dir, cfg["seed"])
    optim = strategy.create_optimizer(model)
    model, optim, sched = strategy.prepare((model, optim, None))
    strategy.setup_inference_engine(None, "fake")
    stats, out = _train_sync_generate(strategy, model, optim, sched)
    full = strategy.full_state_dict(model)
    errors = {}
    strategy.setup_inference_engine(None, "hf")
    try:
        strategy.update_engine_weights(model)
    except LoraError as exc:
        errors["no_adapters"] = str(exc)
    strategy.close()
    return {"generated": [o.output_token_ids for o in out], "stats": stats, "full": full,
            "errors": errors}  # fmt: skip


def cuda_channel_case(cfg: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """One trainer rank and one engine rank on their own GPUs: a trained model's sync
    goes over the NCCL channel, verified; greedy generation after it."""
    from lightrft.engines import SamplingParams

    made = _trainer(cfg, model_dir)
    if isinstance(made, dict):
        return made
    strategy, actor, optim, sched = made
    verified_before = strategy.verify_engine_weights(actor)["max_logprob_gap"]
    _train(strategy, actor, optim, sched, steps=2)
    stats = strategy.update_engine_weights(actor, verify=True)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    outputs = strategy.gather_and_generate(PROMPTS[0], greedy)
    channel = strategy.engine_link.remote.channel
    result = {
        "channel_device": str(channel.device),
        "channel_transport": channel.transport,
        "verified_before": verified_before,
        "sync_gap": stats["max_logprob_gap"],
        "tensors": stats["tensors"],
        "generated": [o.output_token_ids for o in outputs],
    }
    strategy.close()
    return result
