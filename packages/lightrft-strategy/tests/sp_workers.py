"""Rank functions for the sequence-parallel parity tests (importable by the launcher).

One global batch of 4 rows is split over the data-parallel replicas as
``setup_dataloader`` splits data: the ranks of a sequence-parallel group are one replica
and hold the same rows. Each rank reports its rows' per-token log-probabilities and
loss, the full gradient of every parameter after the first backward, and the full
parameters after a few steps.
"""

from __future__ import annotations

from typing import Any

import torch

from lightrft.strategy import get_strategy
from lightrft.testing.models import tiny_hf_causal_lm

from .workers import config

ROWS, LENGTH = 4, 11  # 11: not a multiple of 2 or 4, so the group pads
#: heads and key-value heads both divisible by 2
SP_MODEL = {"num_attention_heads": 4, "num_key_value_heads": 2}


def batch(kind: str) -> dict[str, Any]:
    """The global batch: ``padded`` (left and right padding, an attention mask) or
    ``packed`` (several samples per row, positions restarting at 0, no mask)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (ROWS, LENGTH), generator=generator)
    if kind == "padded":
        mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
        mask[0, :3] = 0  # left padding, as rollouts are
        mask[1, 8:] = 0  # right padding
        mask[3, :1] = 0
        return {"input_ids": ids, "attention_mask": mask}
    starts = [[0, 4], [0, 6, 9], [0], [0, 2, 3, 7]]
    positions = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for begin, end in zip(row_starts, [*row_starts[1:], LENGTH], strict=True):
            positions[row, begin:end] = torch.arange(end - begin)
    # use_cache=False: transformers keeps packed samples apart only without a cache
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}


def _scored(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which next-token predictions count: both tokens real, in the same sample."""
    ids = inputs["input_ids"]
    keep = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"].bool()
        keep &= mask[:, :-1] & mask[:, 1:]
    if "position_ids" in inputs:
        keep &= inputs["position_ids"][:, 1:] != 0
    return keep


def log_probs_and_loss(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    logits = model(**inputs).logits.float()
    ids = inputs["input_ids"]
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = _scored(inputs).float()
    loss = -((lp * keep).sum(-1) / keep.sum(-1)).mean()  # per-row mean, then the rows'
    return lp, loss


def _replica_rows(strategy: Any) -> slice:
    """This rank's rows of the global batch: its data-parallel replica's share."""
    sp = strategy.config.sp_size
    replicas, replica = strategy.world_size // sp, strategy.get_rank() // sp
    rows = ROWS // replicas
    return slice(replica * rows, (replica + 1) * rows)


def parity_case(cfg_changes: dict[str, Any], kinds: list[str], steps: int = 3) -> dict[str, Any]:
    """Train a tiny Qwen2 ``steps`` steps on each kind of batch; report rank-local
    log-probabilities and losses, the first step's full gradients and the final full
    parameters (rank 0)."""
    strategy = get_strategy(config(**cfg_changes))
    mine = _replica_rows(strategy)
    out: dict[str, Any] = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = tiny_hf_causal_lm(**SP_MODEL)
        (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
            model, None, None, None, None, max_steps=10
        )
        inputs = {k: v[mine] if torch.is_tensor(v) else v for k, v in batch(kind).items()}
        record: dict[str, Any] = {"rows": [mine.start, mine.stop], "layer_tokens": []}
        # what one decoder layer holds on this rank: [rows, tokens, hidden]
        layer = strategy.unwrap_model(actor).model.layers[0]
        layer.register_forward_pre_hook(
            lambda _m, args, rec=record: rec["layer_tokens"].append(list(args[0].shape[:2]))
        )
        for step in range(steps):
            lp, loss = log_probs_and_loss(actor, inputs)
            strategy.backward(loss, actor, optim)
            if step == 0:
                record["log_probs"] = lp.detach()
                record["scored"] = _scored(inputs)
                record["loss"] = loss.item()
                record["grads"] = strategy.full_gradients(actor)
            strategy.optimizer_step(optim, actor, sched)
        record["params"] = {
            k: v.detach().clone() for k, v in strategy.full_state_dict(actor).items()
        }
        out[kind] = record
    strategy.close()
    return out


# -- model families, upstream's call shapes and errors (the raw hook on a 2-rank group) --


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, **SP_MODEL))  # fmt: skip


def _qwen2_vl() -> Any:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from lightrft.testing.models import TINY_QWEN2_VL

    text = {**TINY_QWEN2_VL["text_config"], **SP_MODEL}
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 6, 6]}  # head_dim 32
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(**{**TINY_QWEN2_VL, "text_config": text}))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, head_dim=16, **SP_MODEL))  # fmt: skip


def _qwen2_5_vl() -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from lightrft.testing.models import TINY_QWEN2_VL

    text = {**TINY_QWEN2_VL["text_config"], **SP_MODEL}
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 6, 6]}
    vision = {"depth": 1, "hidden_size": 64, "out_hidden_size": 128, "num_heads": 2,
              "intermediate_size": 128, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 56,
              "fullatt_block_indexes": [0]}  # fmt: skip
    tokens = {k: TINY_QWEN2_VL[k] for k in TINY_QWEN2_VL if k.endswith("token_id")}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    return Qwen2_5_VLForConditionalGeneration(config)


def _vl_inputs() -> dict[str, Any]:
    """Two rows, each with one 4-token image (16 patches of 14x14, merged 2x2)."""
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(0, 400, (2, 9), generator=generator)
    image = torch.tensor([502, 500, 500, 500, 500, 503])
    ids = torch.cat([text[:, :3], image.expand(2, -1), text[:, 3:]], dim=1)  # 15 tokens
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(32, 1176, generator=generator),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "mm_token_type_ids": (ids == 500).long(),
    }


def _rank_rows(inputs: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    rows = inputs["input_ids"].shape[0] // world
    mine = {k: v[rank * rows : (rank + 1) * rows] if torch.is_tensor(v) else v
            for k, v in inputs.items()}  # fmt: skip
    if "pixel_values" in inputs:  # 16 patches per image, one image per row
        mine["pixel_values"] = inputs["pixel_values"][rank * rows * 16 : (rank + 1) * rows * 16]
    return mine


def families_case() -> dict[str, Any]:
    """For Llama (padded rows), Qwen3 (packed rows), Qwen2-VL and Qwen2.5-VL (an image per
    row), on 2 ranks each holding
    its own rows: the log-probabilities and the summed gradients of the hooked model
    against the same model unhooked on the whole batch, in this process."""
    import copy

    import torch.distributed as dist

    from lightrft.strategy import ulysses

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for name, build, inputs in (
        ("llama", _llama, batch("padded")),
        ("qwen3", _qwen3, batch("packed")),
        ("qwen2_vl", _qwen2_vl, _vl_inputs()),
        ("qwen2_5_vl", _qwen2_5_vl, _vl_inputs()),
    ):
        torch.manual_seed(0)
        reference = build()
        hooked = ulysses.apply_ulysses(copy.deepcopy(reference), dist.group.WORLD)
        ref_lp, ref_loss = log_probs_and_loss(reference, inputs)
        ref_loss.backward()
        mine = _rank_rows(inputs, rank, world)
        lp, loss = log_probs_and_loss(hooked, mine)
        loss.backward()
        worst = 0.0
        for (_, p_ref), (_, p) in zip(reference.named_parameters(), hooked.named_parameters(),
                                      strict=True):  # fmt: skip
            if p_ref.grad is None:
                continue
            grad = p.grad.clone()
            dist.all_reduce(grad)  # what data parallelism over the 2 ranks averages
            worst = max(worst, float((grad / world - p_ref.grad).abs().max()))
        rows = slice(*[rank * lp.shape[0], (rank + 1) * lp.shape[0]])
        keep = _scored(mine)
        out[name] = {
            "log_prob_diff": float((lp - ref_lp[rows]).detach()[keep].abs().max()),
            "grad_diff": worst,
            "loss": loss.item(),
            "ref_loss": ref_loss.item(),
        }
    return out


def upstream_shapes_case() -> dict[str, Any]:
    """sp_size=2 on 2 ranks (one replica): the loader gives both ranks the same items;
    upstream's experience-maker shape (preprocess, model, postprocess) on the replica's
    rows computes them once; rows that differ per rank are computed together; and the
    errors raised before any work."""
    import torch.distributed as dist

    from lightrft.strategy.fsdp2 import FSDP2Strategy
    from lightrft.strategy.ulysses import SequenceParallelError
    from lightrft.testing.models import TinyRegressor

    strategy = FSDP2Strategy(device="cpu", sp_size=2, train_batch_size=2, bf16=False,
                             micro_train_batch_size=1)  # fmt: skip
    rank = strategy.get_rank()
    loader = strategy.setup_dataloader(list(range(8)), batch_size=2, shuffle=True)
    torch.manual_seed(0)
    reference = tiny_hf_causal_lm(**SP_MODEL)
    torch.manual_seed(0)
    model = strategy.prepare(tiny_hf_causal_lm(**SP_MODEL))
    tokens: list[list[int]] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda _m, args: tokens.append(list(args[0].shape[:2]))
    )
    rows = batch("padded")
    keep = _scored({k: v[:2] for k, v in rows.items()})
    samples = [{k: v[i : i + 1] for k, v in rows.items()} for i in range(2)]  # the replica's
    kept = strategy.sp_data_processor.preprocess(samples)
    inputs = {k: torch.cat([s[k] for s in kept]) for k in kept[0]}
    with torch.no_grad():
        lp, _ = log_probs_and_loss(model, inputs)
        ref_lp, _ = log_probs_and_loss(reference, {k: v[:2] for k, v in rows.items()})
        own = {k: v[rank : rank + 1] for k, v in rows.items()}  # rows differing per rank
        own_lp, _ = log_probs_and_loss(model, own)
    out: dict[str, Any] = {
        "loader": [batch_.tolist() for batch_ in loader],
        "processor_keeps": kept is samples and strategy.sp_data_processor.postprocess(lp) is lp,
        "layer_tokens": tokens,
        "lp_diff": float((lp - ref_lp)[keep].abs().max()),
        "own_lp_diff": float((own_lp[0] - ref_lp[rank])[keep[rank]].abs().max()),
        "errors": {},
    }
    for name, build in (
        ("kv_heads", lambda: tiny_hf_causal_lm()),  # 1 key-value head
        ("family", TinyRegressor),
    ):
        try:
            strategy.prepare(build())
        except SequenceParallelError as exc:
            out["errors"][name] = str(exc)
    cache = _one_token_cache(reference)
    try:
        model(input_ids=rows["input_ids"][:1, :1], past_key_values=cache)
    except SequenceParallelError as exc:
        out["errors"]["cache"] = str(exc)
    dist.barrier()
    strategy.close()
    return out


def _one_token_cache(model: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1]]), use_cache=True).past_key_values


def checkpoint_case(
    cfg_changes: dict[str, Any], steps: int, load_dir: str | None, save_dir: str | None
) -> dict[str, Any]:
    """Load a checkpoint (if any), train ``steps`` steps on the padded batch, save (if
    asked); rank 0 reports the full parameters after loading and at the end."""
    strategy = get_strategy(config(**cfg_changes))
    rank = strategy.get_rank()
    torch.manual_seed(0)
    model = tiny_hf_causal_lm(**SP_MODEL)
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, None, max_steps=10
    )
    out: dict[str, Any] = {}
    if load_dir is not None:
        strategy.load_ckpt(actor, load_dir)
        out["loaded"] = strategy.full_state_dict(actor)
    mine = _replica_rows(strategy)
    inputs = {k: v[mine] for k, v in batch("padded").items()}
    for _ in range(steps):
        _, loss = log_probs_and_loss(actor, inputs)
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)
    if save_dir is not None:
        strategy.save_ckpt(actor, save_dir)
    out["final"] = strategy.full_state_dict(actor)
    strategy.close()
    return out if rank == 0 else {}


def rollouts_case(cfg_changes: dict[str, Any]) -> dict[str, Any]:
    """At ``sp_size`` 2 with a fake engine on each rank: the group's ranks generate the
    same prompts (then different ones). Reports each rank's engine calls and prompts
    generated, and the outputs it got."""
    from lightrft.engines import SamplingParams
    from lightrft.testing import FakeEngine

    strategy = get_strategy(config(**cfg_changes))
    engine = FakeEngine(vocab_size=16)
    strategy.setup_inference_engine(engine)
    rank = strategy.get_rank()
    params = SamplingParams(max_new_tokens=3, n=2)
    same = strategy.gather_and_generate([[1, 2], [3]], params)
    record: dict[str, Any] = {
        "same": [o.output_token_ids for o in same],
        "same_calls": engine.generate_calls,
        "same_prompts": list(engine.last_prompts or []) if engine.generate_calls else [],
    }
    own = strategy.gather_and_generate([[rank + 4]], params)
    record["own"] = [o.output_token_ids for o in own]
    record["own_calls"] = engine.generate_calls - record["same_calls"]
    strategy.close()
    return record
