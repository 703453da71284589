"""A training harness for strategy tests: the loop every backend runs, and the plain
single-process torch computation it must equal.

:func:`train` is a rank function (run it with :func:`lightrft.testing.launcher.run_distributed`
or in one process): it builds the strategy with ``get_strategy``, trains a model from
:mod:`lightrft.testing.models` on a :class:`~lightrft.testing.models.RegressionTask`
and reports the losses, the samples each micro-batch drew, the gradient norms and rank
0's full final state. :func:`reference` replays exactly those samples in one process
(every rank's micro-batches summed with weight ``1 / (micro-batches x ranks)``, one
global clip, AdamW with weight decay on matrices only), with a learning-rate schedule
the caller writes out (:func:`upstream_lr_factor` for upstream's default), so that a
strategy's own ``build_scheduler`` is never its own reference.

    result = run_distributed(train, world_size=2, args=(cfg, 4))
    expected = reference(cfg, 4, [r["used"] for r in result])
    assert_states_close(result[0]["state"], expected["state"], rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.testing.models import RegressionTask, TinyRegressor, greedy_reference

__all__ = [
    "assert_states_close", "reference", "train", "train_sync_generate", "upstream_lr_factor",
]  # fmt: skip

ModelFactory = Callable[[], nn.Module]
TaskFactory = Callable[[], RegressionTask]


def _is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" for p in model.parameters())


def train(
    cfg: dict[str, Any],
    steps: int,
    *,
    model: ModelFactory = TinyRegressor,
    task: TaskFactory = RegressionTask,
    max_steps: int = 100,
    save_dir: str | Path | None = None,
    load_dir: str | Path | None = None,
    client_state: dict[str, Any] | None = None,
    meta_init: bool = False,
    init_context: bool = True,
    ema_beta: float | None = None,
    defer_setup: bool = False,
    record_initial: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of ``model()`` on ``task()`` with the strategy
    ``get_strategy(cfg)`` (seeded by ``cfg["seed"]``; the schedule runs over
    ``max_steps``).

    Optionally resume from ``load_dir`` first and save to ``save_dir`` (with
    ``client_state``) after. ``meta_init`` builds under ``init_model_context(meta_init=True)``
    with a different seed per rank (only rank 0's weights may survive);
    ``init_context=False`` builds outside the strategy's context. With ``ema_beta``,
    the strategy's ``moving_average`` runs after each optimizer step into (a) a model
    built and prepared like the actor and (b) a plain module, both starting from the
    actor's initial weights. ``defer_setup`` builds the strategy deferred and sets it
    up explicitly. ``record_initial`` also returns the prepared model's full state
    before training (give it to :func:`reference` as ``initial``: a model built under
    ZeRO-3's ``init_model_context`` on CUDA draws its random weights on the GPU, from
    another generator than the reference's CPU one).

    Returns, on every rank: ``losses`` (per step, averaged over ranks), ``used`` (the
    sample indices of each micro-batch), ``stepped`` (``optimizer_step``'s answer per
    micro-batch), ``norms`` (the clipped-before gradient norm per step), ``lr`` (the
    last learning rate), ``client`` (the client state loaded), ``built_on_meta``;
    on rank 0 only (``None`` elsewhere): ``state`` (the full model state), ``ema`` and
    ``initial`` (with ``record_initial``).
    """
    from lightrft.strategy import get_strategy

    strategy = get_strategy(cfg, defer_setup=defer_setup)
    if defer_setup:
        if strategy.is_ready:
            raise AssertionError("get_strategy(defer_setup=True) returned a ready strategy")
        strategy.setup_distributed()
    torch.manual_seed(cfg["seed"] + (strategy.get_rank() if meta_init else 0))
    with strategy.init_model_context(meta_init=meta_init) if init_context else nullcontext():
        net = model()
    built_on_meta = any(p.is_meta for p in net.parameters())
    emas: dict[str, nn.Module] = {}
    if ema_beta is not None:
        for name in ("prepared", "plain"):
            torch.manual_seed(cfg["seed"])  # the actor's initial weights
            with strategy.init_model_context() if name == "prepared" else nullcontext():
                emas[name] = model()
        emas["prepared"] = strategy.prepare_model(emas["prepared"])
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        net, None, None, None, None, max_steps=max_steps
    )
    initial = strategy.full_state_dict(actor) if record_initial else None  # collective
    loader = strategy.setup_dataloader(task())
    client: dict[str, Any] = {}
    if load_dir is not None:
        _, client = strategy.load_ckpt(actor, load_dir)
    batches = iter(loader)
    losses, used, stepped, norms = [], [], [], []
    for _ in range(steps):
        micro = []
        for _ in range(strategy.accumulated_gradient):
            index, x, y = next(batches)
            # in fp32 whatever the model computes in (CUDA's mse_loss backward refuses a
            # bf16 prediction against an fp32 target)
            pred = actor(x.to(strategy.device)).float()
            loss = nn.functional.mse_loss(pred, y.to(strategy.device))
            strategy.backward(loss, actor, optim)
            stepped.append(strategy.optimizer_step(optim, actor, sched))
            if stepped[-1]:
                for ema in emas.values():
                    strategy.moving_average(actor, ema, ema_beta or 0.0)
            micro.append(loss.detach().cpu())
            used.append(index.tolist())
        losses.append(float(strategy.all_reduce(torch.stack(micro).mean())))
        norms.append(strategy.step_state(actor).last_grad_norm)
    if save_dir is not None:
        strategy.save_ckpt(actor, save_dir, client_state=client_state)
    state = strategy.full_state_dict(actor)  # collective: every rank calls it
    ema_states: dict[str, Any] = {}
    if emas:
        ema_states["sharded"] = _is_sharded(emas["prepared"])
        ema_states["prepared"] = strategy.full_state_dict(emas["prepared"])
        ema_states["plain"] = {k: v.detach().clone() for k, v in emas["plain"].state_dict().items()}
    rank = strategy.get_rank()
    strategy.close()
    return {
        "losses": losses, "used": used, "stepped": stepped, "norms": norms,
        "lr": sched.get_last_lr()[0], "client": client, "built_on_meta": built_on_meta,
        "state": state if rank == 0 else None, "ema": ema_states if rank == 0 else None,
        "initial": initial if rank == 0 else None,
    }  # fmt: skip


def upstream_lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Upstream's default schedule (transformers' ``cosine_with_min_lr``), written out:
    linear warmup from 0 over ``warmup`` steps, then cosine decay to ``min_ratio``."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def reference(
    cfg: dict[str, Any],
    steps: int,
    used: list[list[list[int]]],
    *,
    model: ModelFactory = TinyRegressor,
    task: TaskFactory = RegressionTask,
    lr_factor: Callable[[int], float] | None = None,
    ema_beta: float | None = None,
    initial: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The same ``steps`` in one process with plain torch in fp32, replaying ``used``
    (each rank's ``train(...)["used"]``), from ``model()`` seeded by ``cfg["seed"]`` or
    from ``initial`` (``train(..., record_initial=True)["initial"]``): AdamW (betas
    0.9/0.95) with weight decay ``cfg["l2"]`` on matrices only (biases and norm weights
    are 1-d), one global clip at ``cfg["max_norm"]``, and the learning rate
    ``cfg["actor_learning_rate"] * lr_factor(step)`` (constant when ``lr_factor`` is None).

    Returns ``losses``, ``state`` (the final state dict) and ``ema`` (of the
    parameters after each step, with ``ema_beta``)."""
    torch.manual_seed(cfg["seed"])
    net = model()
    if initial is not None:
        net.load_state_dict(initial)
    data = task()
    ema = {n: p.detach().clone() for n, p in net.named_parameters()}
    params = list(net.parameters())
    optim = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg["l2"]},
         {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
        lr=cfg["actor_learning_rate"], betas=(0.9, 0.95),
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor) if lr_factor else None
    world, accum = len(used), len(used[0]) // steps
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(accum):
            for rank in range(world):
                index = used[rank][step * accum + k]
                loss = nn.functional.mse_loss(net(data.x[index]), data.y[index])
                (loss / (accum * world)).backward()  # type: ignore[no-untyped-call]
                total += loss.item() / (accum * world)
        if cfg["max_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg["max_norm"])
        optim.step()
        if sched is not None:
            sched.step()
        optim.zero_grad()
        losses.append(total)
        if ema_beta is not None:
            for name, param in net.named_parameters():
                ema[name] = ema_beta * ema[name] + (1 - ema_beta) * param.detach()
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "ema": ema,
    }


def assert_states_close(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``torch.testing.assert_close`` per entry (its default tolerances unless both
    ``rtol`` and ``atol`` are given), naming the entry that differs; the key sets must
    be equal."""
    if actual.keys() != expected.keys():
        raise AssertionError(f"state keys differ: {sorted(set(actual) ^ set(expected))}")
    for name in actual:
        try:
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def _threads_and_cores() -> tuple[int, list[int]]:
    """torch's intra-op threads and the CPUs this process may run on (none listed where
    the platform cannot say, as macOS)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return torch.get_num_threads(), sorted(affinity(0)) if affinity else []


def train_sync_generate(
    cfg: dict[str, Any], model_dir: str, engine_type: str = "hf"
) -> dict[str, Any]:
    """Rank function, for engine tests on 2 ranks: train the Hugging Face model in
    ``model_dir`` (e.g. :func:`lightrft.testing.models.save_tiny_qwen2`, vocabulary 128)
    a few steps with ``get_strategy(cfg)``, sync it into the engine ``engine_type``
    built from the config (upstream's ``setup_inference_engine(args, engine_type)``),
    generate greedily for uneven prompts (3 on rank 0, 1 on rank 1), and return with it
    what transformers' ``generate`` gives on the trained full weights (rank 0:
    ``expected``, every rank's prompts in rank order). Also exercised: the sync
    verification passes after a sync (``stats["max_logprob_gap"]``) and catches a
    skipped one (``errors["stale"]``); an out-of-vocabulary prompt on rank 1
    (``errors["prompt"]`` on the ranks of its engine group) leaves the engine usable
    (``usable``); a sync under other names is refused (``errors["names"]``) and keeps
    the engine's weights (``kept``); building the engine leaves the rank's torch threads
    and CPU affinity as they were (``threads_kept``)."""
    from transformers import AutoModelForCausalLM

    from lightrft.engines import EngineError, PromptError, SamplingParams, WeightMismatchError
    from lightrft.strategy import get_strategy

    strategy = get_strategy({**cfg, "pretrain": model_dir})
    # built plainly: from_pretrained under ZeRO-3's partitioning context needs
    # transformers' own DeepSpeed integration; prepare partitions it
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, 10
    )
    rank = strategy.get_rank()
    threads = _threads_and_cores()
    engine = strategy.setup_inference_engine(None, engine_type, actor=None)
    # the trainer's threads and cores are its own: an engine built in the same process
    # must leave them (vLLM's CPU worker sets up OpenMP thread binding as it starts)
    threads_kept = _threads_and_cores() == threads
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    prompts = [[5, 17, 99, 3], [42], [7, 7, 7, 7, 7]] if rank == 0 else [[11, 12]]
    before = strategy.gather_and_generate(prompts, greedy)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3 * strategy.accumulated_gradient):  # lr 1e-2: the greedy output moves
        ids = torch.randint(0, 128, (2, 12), generator=gen).to(strategy.device)
        strategy.backward(actor(input_ids=ids, labels=ids).loss, actor, optim)
        strategy.optimizer_step(optim, actor, None)
    stats = strategy.update_engine_weights(actor, bucket_bytes=64 * 1024, verify=True)
    after = strategy.gather_and_generate(prompts, greedy)
    full = strategy.full_state_dict(actor)
    every_prompt: list[Any] = [None] * strategy.world_size  # what each rank asked for
    torch.distributed.all_gather_object(every_prompt, prompts)
    errors: dict[str, str] = {}
    bad = [[1, 2], [500]] if rank == 1 else [[3]]  # rank 1's second prompt is out of vocab
    try:
        strategy.gather_and_generate(bad, greedy)
    except PromptError as exc:
        errors["prompt"] = str(exc)
    usable = strategy.gather_and_generate(prompts, greedy) == after
    try:  # a sync under other names: refused before the first bucket
        strategy.update_engine_weights(actor, name_map=lambda n: "x." + n)
    except WeightMismatchError as exc:
        errors["names"] = str(exc)
    kept = strategy.gather_and_generate(prompts, greedy) == after
    for _ in range(strategy.accumulated_gradient):  # train on without syncing
        ids = torch.randint(0, 128, (2, 12), generator=gen).to(strategy.device)
        strategy.backward(actor(input_ids=ids, labels=ids).loss, actor, optim)
        strategy.optimizer_step(optim, actor, None)
    try:
        strategy.verify_engine_weights(actor)
    except EngineError as exc:
        errors["stale"] = str(exc)
    expected = None
    if rank == 0:  # transformers' generate on the trained weights, prompt by prompt
        reference: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        reference.load_state_dict(full)
        expected = greedy_reference(reference, [p for chunk in every_prompt for p in chunk], 6)
    strategy.close()
    return {
        "engine": type(engine).__name__,
        "before": [o.output_token_ids for o in before],
        "after": [o.output_token_ids for o in after],
        "prompts_back": [o.prompt_token_ids for o in after],
        "versions": sorted({o.weight_version for o in after}),
        "stats": stats,
        "expected": expected,
        "errors": errors,
        "usable": usable,
        "kept": kept,
        "threads_kept": threads_kept,
    }
