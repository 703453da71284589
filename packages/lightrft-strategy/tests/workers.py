"""Rank functions for the distributed tests of lightrft-strategy.

They live in an importable module so the launcher's spawned processes can find them.
The model, task, training loop and single-process reference are lightrft.testing's
(:mod:`lightrft.testing.models`, :mod:`lightrft.testing.harness`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.strategy import get_strategy
from lightrft.testing.harness import assert_states_close, reference, train  # noqa: F401
from lightrft.testing.models import RegressionTask, TinyRegressor, tiny_hf_causal_lm

DIM = 16  # TinyRegressor's default width


def config(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "backend": "fsdp2",
        "device": "cpu",
        "bf16": False,
        "seed": 0,
        "train_batch_size": 8,
        "micro_train_batch_size": 2,
        "max_norm": 0.3,
        "actor_learning_rate": 5e-3,
        "lr_warmup_ratio": 0.0,
        "lr_scheduler": "constant_with_warmup",
        "l2": 0.01,
    }
    base.update(changes)
    return base


def load_full_checkpoint(cfg: dict[str, Any], load_dir: str) -> dict[str, Any]:
    """Load ``load_dir`` at this run's world size; return rank 0's full model state."""
    strategy = get_strategy(cfg)
    model = TinyRegressor()
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=100
    )
    path, _ = strategy.load_ckpt(actor, Path(load_dir))
    state = strategy.full_state_dict(actor)
    rank, world = strategy.get_rank(), strategy.world_size
    strategy.close()
    return {"state": state if rank == 0 else None, "world": world, "path": path}


def collectives_case() -> dict[str, Any]:
    strategy = get_strategy(config())
    rank = strategy.get_rank()
    out = {
        "mean_int": strategy.all_reduce(rank + 1),
        "sum_int": strategy.all_reduce(rank + 1, "sum"),
        "max_float": strategy.all_reduce(float(rank) * 2.5, "max"),
        "min_tensor": strategy.all_reduce(torch.tensor([rank, 10 - rank]), "min"),
        "mean_tensor": strategy.all_reduce(torch.tensor([1.0, 3.0]) * (rank + 1)),
        "dict": strategy.all_reduce({"loss": float(rank), "n": torch.tensor(rank + 1.0)}, "sum"),
        "gather_uneven": strategy.all_gather(torch.full((rank + 1, 2), float(rank))),
        "gather_scalar": strategy.all_gather(rank * 10),
        "gather_dict": strategy.all_gather({"r": torch.tensor([rank])}),
        "min_uint8": strategy.all_reduce(torch.tensor([0, 5], dtype=torch.uint8) + rank, "min"),
        "gather_0d": strategy.all_gather(torch.tensor(float(rank))),
        # the same keys inserted in a different order on each rank
        "dict_order": strategy.all_reduce(
            {"a": 1.0, "b": 10.0} if rank == 0 else {"b": 20.0, "a": 2.0}, "sum"
        ),
    }
    calls = []
    real = torch.distributed.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counted  # type: ignore[assignment]
    try:  # a dict of numbers (a step's metrics) goes in one collective
        numbers = {"loss": 0.5 + rank, "tokens": 10 * (rank + 1), "kl": 1e-3, "z": -1.0}
        out["numbers"] = strategy.all_reduce(numbers)
        out["numbers_max"] = strategy.all_reduce(numbers, "max")
    finally:
        torch.distributed.all_reduce = real
    out["number_collectives"] = len(calls)
    strategy.close()
    return out


def ema_case(steps: int = 3, beta: float = 0.9) -> dict[str, Any]:
    """EMA of a sharded model into (a) a model sharded the same way and (b) a plain
    module, against EMA computed on full tensors."""
    strategy = get_strategy(config())
    model = TinyRegressor()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sharded_ema, plain_ema = TinyRegressor(), TinyRegressor()  # both start as copies of the model
    sharded_ema.load_state_dict(expected)
    plain_ema.load_state_dict(expected)
    sharded_ema = strategy.prepare_model(sharded_ema)
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, 10
    )
    batches = iter(strategy.setup_dataloader(RegressionTask()))
    for _ in range(steps * strategy.accumulated_gradient):
        _, x, y = next(batches)
        strategy.backward(nn.functional.mse_loss(actor(x), y), actor, optim)
        if strategy.optimizer_step(optim, actor, None):
            current = {n: p.full_tensor() for n, p in actor.named_parameters()}  # type: ignore[attr-defined]
            for name, value in current.items():
                expected[name] = beta * expected[name] + (1 - beta) * value
            strategy.moving_average(actor, sharded_ema, beta)
            strategy.moving_average(actor, plain_ema, beta)
    sharded = {n: p.full_tensor() for n, p in sharded_ema.named_parameters()}  # type: ignore[attr-defined]
    plain = {n: p.detach().clone() for n, p in plain_ema.named_parameters()}
    strategy.close()
    params = {n for n, _ in TinyRegressor().named_parameters()}
    return {
        "sharded": sharded,
        "plain": plain,
        "expected": {k: v for k, v in expected.items() if k in params},
    }


def save_model_case(out_dir: str) -> dict[str, Any]:
    """Train a tiny HF model a step under FSDP2 (sharded per decoder layer via
    _no_split_modules), save_model, and return the sharded model's logits."""
    strategy = get_strategy(config(train_batch_size=2, micro_train_batch_size=1))
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        tiny_hf_causal_lm(), None, None, None, None, 10
    )
    ids = torch.arange(16).reshape(1, 16) % 128
    loss = actor(input_ids=ids, labels=ids).loss
    strategy.backward(loss, actor, optim)
    stepped = strategy.optimizer_step(optim, actor, None)
    wrapped = sorted(
        {type(m).__name__ for m in actor.modules() if type(m).__name__.startswith("FSDP")}
    )
    strategy.save_model(actor, None, out_dir)
    actor.eval()
    with torch.no_grad():
        logits = actor(input_ids=ids).logits
    strategy.close()
    return {"logits": logits, "stepped": stepped, "wrapped": wrapped}


def rotation_case(save_dir: str, saves: int, max_num: int) -> list[str]:
    strategy = get_strategy(config())
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    batches = iter(strategy.setup_dataloader(RegressionTask()))
    tags = []
    for _ in range(saves):
        for _ in range(strategy.accumulated_gradient):
            _, x, y = next(batches)
            strategy.backward(nn.functional.mse_loss(actor(x), y), actor, optim)
            strategy.optimizer_step(optim, actor, None)
        tags.append(strategy.save_ckpt(actor, save_dir, max_num=max_num).name)
    strategy.close()
    return tags


def killed_save_case(save_dir: str, kill_in: str) -> None:
    """Save step 1, then die (SIGKILL) in the middle of saving step 2."""
    import os
    import signal

    from lightrft.strategy.checkpoint import layout

    strategy = get_strategy(config())
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    for _ in range(strategy.accumulated_gradient):
        strategy.backward(actor(torch.ones(2, DIM)).pow(2).mean(), actor, optim)
        strategy.optimizer_step(optim, actor, None)
    strategy.save_ckpt(actor, save_dir, tag="step1")

    def die(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if kill_in == "backend_state":  # after the model state is on disk, before the rest
        original = strategy.backend.save_state

        def save_then_die(*args: Any) -> None:
            original(*args)
            die()

        strategy.backend.save_state = save_then_die  # type: ignore[method-assign]
    else:  # commit: metadata written, directory not yet renamed
        real_replace = os.replace

        def replace_then_die(src: Any, dst: Any) -> None:
            if str(src).endswith(".partial"):
                die()
            real_replace(src, dst)

        layout.os.replace = replace_then_die  # type: ignore[assignment]
    strategy.save_ckpt(actor, save_dir, tag="step2")


def offload_case() -> dict[str, Any]:
    """maybe_offload_optimizer moves Adam state to CPU; maybe_load_optimizer brings it
    back unchanged (CUDA only: on CPU both are where they started)."""
    strategy = get_strategy(config(device="cuda", train_batch_size=2, micro_train_batch_size=2))
    (actor, optim, _), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    strategy.backward(actor(torch.ones(2, DIM, device="cuda")).pow(2).mean(), actor, optim)
    strategy.optimizer_step(optim, actor, None)
    state = optim.state[next(iter(optim.state))]
    before = state["exp_avg"].full_tensor().cpu()
    strategy.maybe_offload_optimizer(optim)
    offloaded = state["exp_avg"].device.type
    strategy.maybe_load_optimizer(optim)
    reloaded = state["exp_avg"].device.type
    unchanged = bool(torch.equal(state["exp_avg"].full_tensor().cpu(), before))
    strategy.close()
    return {"offloaded": offloaded, "reloaded": reloaded, "unchanged": unchanged}


def rank0_fails_while_saving_case(save_dir: str) -> str:
    """Rank 0 fails writing its part of a checkpoint: every rank must raise, none hang."""
    strategy = get_strategy(config())
    (actor, _, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    strategy.save_ckpt(actor, save_dir, tag="good")
    if strategy.get_rank() == 0:

        def broken() -> dict[str, Any]:
            raise OSError("disk full (simulated)")

        sched.state_dict = broken  # type: ignore[method-assign]
    try:
        strategy.save_ckpt(actor, save_dir, tag="bad")
    except Exception as exc:  # report what each rank saw
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "no error"
    strategy.close()
    return outcome


def offload_model_case(cfg: dict[str, Any], offload: bool) -> dict[str, Any]:
    """Two steps with offload_model / reload_model between them (when ``offload``):
    accelerator memory before and after, and the losses (equal to a run without)."""
    strategy = get_strategy(cfg)
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyRegressor(), None, None, None, None, 10
    )
    batches = iter(strategy.setup_dataloader(RegressionTask()))
    losses, memory = [], []
    for _ in range(2):
        for _ in range(strategy.accumulated_gradient):
            _, x, y = next(batches)
            x, y = x.to(strategy.device), y.to(strategy.device)
            loss = nn.functional.mse_loss(actor(x), y)
            strategy.backward(loss, actor, optim)
            strategy.optimizer_step(optim, actor, sched)
            losses.append(float(loss))
        if offload:
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            strategy.offload_model(actor)
            after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            strategy.reload_model(actor)
            memory.append((before, after))
    state = strategy.full_state_dict(actor)
    rank = strategy.get_rank()
    strategy.close()
    return {"losses": losses, "memory": memory, "state": state if rank == 0 else None}


def rollout_case(cfg: dict[str, Any], leader_only: bool, stream: bool = False) -> dict[str, Any]:
    """Engine calls on a sharded model: uneven prompts per rank through
    gather_and_generate, a weight sync (records vs the full state; ``stream``: to an
    engine that pulls the tensors in one call), sleep level 2 (stale weights refused)
    and the wake, sync, wake order."""
    from lightrft.engines import EngineError, SamplingParams
    from lightrft.testing import FakeEngine, tensor_digest

    strategy = get_strategy(cfg)
    with strategy.init_model_context():
        model = TinyRegressor()
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(model, None, None, None, None, 10)
    names = [n for n, _ in TinyRegressor().named_parameters()]
    engine = FakeEngine(
        expected_weights=names, generate_on_every_rank=not leader_only, weight_stream=stream
    )
    strategy.setup_inference_engine(engine)
    rank = strategy.get_rank()
    prompts = [[1, 2, 3], [4], [5, 6]] if rank == 0 else [[7, 8]]
    sampling = SamplingParams(max_new_tokens=4, n=2, seed=3)
    before = strategy.gather_and_generate(prompts, sampling)
    expected_before = FakeEngine().generate(prompts, sampling)
    counts = strategy.update_engine_weights(actor, bucket_bytes=4096)
    full = strategy.full_state_dict(actor)
    after = strategy.gather_and_generate(prompts, sampling)
    slept = strategy.maybe_sleep_inference_engine()
    errors = []
    try:
        engine.generate(prompts, sampling)
    except EngineError as exc:
        errors.append(str(exc))
    strategy.wakeup_inference_engine(["weights"])
    strategy.update_engine_weights(actor)
    strategy.wakeup_inference_engine(["kv_cache"])
    again = strategy.gather_and_generate(prompts, sampling)
    strategy.close()
    record = engine.syncs[0]
    return {
        "before": [o.output_token_ids for o in before],
        "expected_before": [o.output_token_ids for o in expected_before],
        "prompts_back": [o.prompt_token_ids for o in before],
        "after": [o.output_token_ids for o in after],
        "again": [o.output_token_ids for o in again],
        "counts": counts,
        "buckets": engine.bucket_sizes,
        "generate_calls": engine.generate_calls,
        "record": {n: (r.shape, r.sha256) for n, r in record.items()},
        "full": {n: (tuple(t.shape), tensor_digest(t)) for n, t in full.items()}
        if rank == 0
        else None,
        "slept": slept,
        "errors": errors,
        "syncs": len(engine.syncs),
    }


def one_engine_fails_case(cfg: dict[str, Any], stream: bool) -> dict[str, Any]:
    """A sync whose engine raises on rank 1 alone, after two tensors: rank 1 must still
    take part in every remaining gather (collective on a sharded model), so rank 0's
    sync completes instead of hanging."""
    from lightrft.engines import EngineError
    from lightrft.testing import FakeEngine

    strategy = get_strategy(cfg)
    with strategy.init_model_context():
        model = TinyRegressor()
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(model, None, None, None, None, 10)
    engine = FakeEngine(weight_stream=stream)
    strategy.setup_inference_engine(engine)
    rank = strategy.get_rank()
    taken: list[str] = []
    update = engine.update_weights

    def failing_on_rank_1(items: Any) -> None:
        items = list(items)
        taken.extend(n for n, _ in items)
        if rank == 1 and len(taken) > 2:
            raise EngineError("the engine failed on rank 1")
        update(items)

    engine.update_weights = failing_on_rank_1  # type: ignore[method-assign]
    error = ""
    try:
        strategy.update_engine_weights(actor, bucket_bytes=1)  # one tensor per bucket
    except EngineError as exc:
        error = str(exc)
    result = {"error": error, "syncs": len(engine.syncs), "taken": len(taken)}
    strategy.close()
    return result


#: Each first use of a deferred strategy that depends on the world, by name.
DEFERRED_USES: dict[str, Any] = {
    "init_model_context": lambda s, m: s.init_model_context().__enter__(),
    "prepare": lambda s, m: s.prepare(m),
    "prepare_models_and_optimizers": lambda s, m: s.prepare_models_and_optimizers(
        m, None, None, None, None, 10
    ),
    "create_optimizer": lambda s, m: s.create_optimizer(m),
    "backward": lambda s, m: s.backward(m(torch.ones(2, DIM)).sum(), m, None),
    "optimizer_step": lambda s, m: s.optimizer_step(None, m, None),
    "setup_dataloader": lambda s, m: s.setup_dataloader(RegressionTask()),
    "save_ckpt": lambda s, m: s.save_ckpt(m, "never-written"),
    "load_ckpt": lambda s, m: s.load_ckpt(m, "never-read"),
    "all_reduce": lambda s, m: s.all_reduce(1.0),
    "all_gather": lambda s, m: s.all_gather(1.0),
    "accumulated_gradient": lambda s, m: s.accumulated_gradient,
}


def deferred_use_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """A strategy built with defer_setup=True inside a 2-rank job: every world-dependent
    first use must raise (naming setup_distributed()) and join nothing; then an explicit
    setup_distributed() makes it train."""
    import torch.distributed as dist

    strategy = get_strategy(cfg, defer_setup=True)
    errors: dict[str, str | None] = {}
    for name, use in DEFERRED_USES.items():
        try:
            use(strategy, TinyRegressor())
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            errors[name] = None
    out: dict[str, Any] = {
        "errors": errors,
        "world_before": strategy.world_size,
        "group_before": dist.is_initialized(),
        "wrote": Path("never-written").exists(),
    }
    strategy.setup_distributed()
    out["accumulated"] = strategy.accumulated_gradient
    out["world"] = strategy.world_size
    strategy.close()
    return out


def load_model_case(cfg: dict[str, Any], weights: str, prepared: bool) -> dict[str, Any]:
    """load_model(``weights``) into a fresh TinyRegressor (prepared by the strategy or plain);
    return rank 0's full state afterwards, and the errors of bad loads (which must
    leave the weights as they were)."""
    strategy = get_strategy(cfg)
    torch.manual_seed(99)  # other weights than the file's
    model: nn.Module = TinyRegressor()
    if prepared:
        (model, _, _), *_ = strategy.prepare_models_and_optimizers(
            model, None, None, None, None, 10
        )

    def snapshot() -> dict[str, torch.Tensor]:  # a plain module's state aliases its tensors
        return {k: v.clone() for k, v in strategy.full_state_dict(model).items()}

    before = snapshot()
    errors: dict[str, str] = {}
    renamed = Path(weights).with_name("renamed.pt")
    if strategy.get_rank() == 0:
        state = torch.load(weights, weights_only=True)
        torch.save({"model." + k: v for k, v in state.items()}, renamed)
        Path(weights).with_name("corrupt.pt").write_bytes(b"not a checkpoint")
        partial = dict(state)
        partial.pop("head.bias")
        torch.save(partial, Path(weights).with_name("partial.pt"))
    strategy.barrier()
    for label, path, kwargs in [
        ("strict_partial", Path(weights).with_name("partial.pt"), {"strict": True}),
        ("renamed", renamed, {}),
        ("corrupt", Path(weights).with_name("corrupt.pt"), {}),
        ("missing", Path(weights).with_name("absent.pt"), {}),
    ]:
        try:
            strategy.load_model(model, path, **kwargs)
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    untouched = snapshot()
    strategy.load_model(
        model,
        renamed,
        key_replace_fn=lambda sd: {k.removeprefix("model."): v for k, v in sd.items()},
    )
    loaded = strategy.full_state_dict(model)
    with torch.no_grad():  # the wrapped model computes with the loaded weights
        output = model(torch.linspace(-1, 1, 2 * DIM).reshape(2, DIM)).detach()
    rank = strategy.get_rank()
    strategy.close()
    return {
        "before": before if rank == 0 else None,
        "untouched": untouched if rank == 0 else None,
        "loaded": loaded if rank == 0 else None,
        "output": output,
        "errors": errors,
    }


def layout_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """prepare_model with upstream FSDP's shard_size / reshard_after_forward: the mesh
    each model got, its local shard, whether a block stays gathered after forward, and
    the errors of bad sizes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    strategy = get_strategy(cfg)
    layouts: dict[str, Any] = {}
    for label, kwargs in [
        ("default", {}),
        ("replicated", {"shard_size": 1}),
        ("auto", {"shard_size": "auto"}),
        ("auto_training", {"shard_size": "auto", "is_training": True}),
        ("every_rank", {"shard_size": -1}),
        ("capped", {"shard_size": 8}),
        ("keep_gathered", {"reshard_after_forward": False}),
    ]:
        model: Any = strategy.prepare_model(TinyRegressor(), **kwargs)
        weight = model.head.weight
        with torch.no_grad():
            model(torch.ones(2, DIM))
        layouts[label] = {
            "mesh": tuple(weight.device_mesh.shape),
            "local": tuple(weight.to_local().shape),
            "block_sharded_after_forward": isinstance(model.layers[0].up.weight, DTensor),
            "fsdp_groups": sum(isinstance(m, FSDPModule) for m in model.modules()),
        }
    errors = {}
    for bad in (0, -2, "half"):
        try:
            strategy.prepare_model(TinyRegressor(), shard_size=bad)
        except ValueError as exc:
            errors[str(bad)] = str(exc)
    none = strategy.prepare_model(None, shard_size=1)  # type: ignore[arg-type]
    strategy.close()
    return {"layouts": layouts, "errors": errors, "none": none}


def tp_group_bad_prompt_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """engine_tp_size=2: rank 1 holds a bad prompt; both ranks of the group must refuse
    before the engine is called, then generate normally."""
    from lightrft.engines import PromptError, SamplingParams
    from lightrft.testing import FakeEngine

    strategy = get_strategy(cfg)
    engine = FakeEngine(vocab_size=16)
    strategy.setup_inference_engine(engine)
    rank = strategy.get_rank()
    error = None
    try:
        strategy.gather_and_generate([[1], [99]] if rank == 1 else [[2]], SamplingParams())
    except PromptError as exc:
        error = str(exc)
    calls_after_error = engine.generate_calls
    outs = strategy.gather_and_generate([[3]] if rank else [[4], [5]], SamplingParams())
    strategy.close()
    return {
        "error": error,
        "calls_after_error": calls_after_error,
        "prompts": [o.prompt_token_ids for o in outs],
    }


def multimodal_gather_case(cfg: dict[str, Any]) -> dict[str, Any]:
    """engine_tp_size=2, upstream's multimodal call: rank 0 passes images nested, rank 1
    flat with counts; the engine must see every prompt of the group with all its
    images, in order. Then rank 1's counts disagree with its images: both ranks fail
    before the engine is called."""
    from lightrft.engines import SamplingParams
    from lightrft.engines.multimodal import MediaError
    from lightrft.testing import FakeEngine

    strategy = get_strategy(cfg)
    engine = FakeEngine(vocab_size=16)
    strategy.setup_inference_engine(engine)
    rank = strategy.get_rank()
    if rank == 0:
        outs = strategy.gather_and_generate(
            SamplingParams(max_new_tokens=2), all_prompt_token_ids=[[1], [2]],
            all_images=[["r0p0a", "r0p0b"], ["r0p1a"]], images_num=[2, 1],
        )  # fmt: skip
    else:
        outs = strategy.gather_and_generate(
            SamplingParams(max_new_tokens=2), all_prompt_token_ids=[[3]],
            all_images=["r1p0a", "r1p0b", "r1p0c"], images_num=[3],
        )  # fmt: skip
    seen = engine.last_prompts
    calls = engine.generate_calls
    error = None
    try:
        strategy.gather_and_generate(
            SamplingParams(), all_prompt_token_ids=[[1]] if rank else [[2]],
            all_images=["x", "y"] if rank else [["z"]], images_num=[1],
        )  # fmt: skip
    except MediaError as exc:
        error = str(exc)
    strategy.close()
    return {
        "seen": seen,
        "mine": [o.prompt_token_ids for o in outs],
        "error": error,
        "calls_after_error": engine.generate_calls - calls,
    }


def train_tiny_hf(cfg: dict[str, Any], steps: int = 2) -> tuple[Any, Any]:
    """A strategy for ``cfg`` and a tiny HF causal LM trained ``steps`` steps on it:
    ``(strategy, actor)``."""
    strategy = get_strategy(cfg)
    torch.manual_seed(cfg["seed"])
    with strategy.init_model_context():
        model = tiny_hf_causal_lm()
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=10
    )
    generator = torch.Generator().manual_seed(strategy.get_rank())
    for _ in range(steps * strategy.accumulated_gradient):
        ids = torch.randint(0, 128, (1, 12), generator=generator)
        loss = actor(input_ids=ids, labels=ids).loss
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)
    return strategy, actor


def tiny_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built here (no download), as
    examples/arithmetic.py's: ``0-9 + = a-z`` are ids 0-37, then ``<eos>``, ``<pad>``,
    ``<unk>`` (within the tiny model's vocabulary of 128)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "0123456789+=abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": 38, "<pad>": 39, "<unk>": 40}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


#: text for the tokenizer checks, and its ids. Known characters only: transformers 5
#: loads a tokenizer beside a qwen2 config.json as Qwen2Tokenizer, rebuilt from its
#: vocabulary (as it does with save_model's output), which drops what the WordLevel
#: model maps to <unk>
TOKENIZER_TEXT = "17+25=42ok<eos>"
TOKENIZER_IDS = [1, 7, 10, 2, 5, 11, 4, 2, 26, 22, 38]


def assert_tokenizer_of(directory: Path, saved: Path | None = None) -> None:
    """``directory`` loads with AutoTokenizer as it is and encodes as
    :func:`tiny_tokenizer`; its files are ``saved``'s, byte for byte."""
    from transformers import AutoTokenizer

    original = tiny_tokenizer()
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert loaded(TOKENIZER_TEXT)["input_ids"] == original(TOKENIZER_TEXT)["input_ids"]
    assert original(TOKENIZER_TEXT)["input_ids"] == TOKENIZER_IDS
    assert (loaded.eos_token_id, loaded.pad_token_id) == (38, 39)
    for file in saved.iterdir() if saved is not None else ():
        assert (directory / file.name).read_bytes() == file.read_bytes(), file.name


def hf_checkpoint_case(
    cfg: dict[str, Any], save_dir: str, hf_dir: str, steps: int = 2, tokenizer: bool = False
) -> None:
    """Train a tiny HF causal LM ``steps`` steps, then ``save_ckpt`` to ``save_dir`` (with
    :func:`tiny_tokenizer` when ``tokenizer``) and ``save_model`` to ``hf_dir``: the two
    outputs ``lightrft ckpt export`` must agree on."""
    strategy, actor = train_tiny_hf(cfg, steps)
    strategy.save_ckpt(actor, save_dir, tokenizer=tiny_tokenizer() if tokenizer else None)
    strategy.save_model(actor, None, hf_dir)
    strategy.close()


def frozen_regressor() -> nn.Module:
    """TinyRegressor with its first block frozen (outside the optimizer, as in LoRA)."""
    model = TinyRegressor()
    model.layers[0].requires_grad_(False)
    return model


def grads_step(strategy: Any, model: nn.Module, optim: torch.optim.Optimizer, scale: float) -> bool:
    """One backward of a fixed batch's squared output (times ``scale``) and an optimizer
    step through ``strategy``; whether the optimizer stepped."""
    x = torch.ones(2, DIM)
    loss = model(x).pow(2).mean() * scale
    strategy.backward(loss, model, optim)
    return bool(strategy.optimizer_step(optim, model, None))
