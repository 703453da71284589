"""One rank of the job that writes a converted checkpoint as DeepSpeed's engine files.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m lightrft.strategy.checkpoint.tools.deepspeed_writer STATE_FILE TAG_DIR

Run by :func:`lightrft.strategy.checkpoint.tools.deepspeed_files.write_deepspeed`. Every rank
builds a module holding the recorded parameters (names, shapes, dtypes, ties and
buffers: :func:`skeleton`), an AdamW over the source's groups with their
hyperparameters, and a DeepSpeed engine of the target stage through the strategy; sets
the full state (:func:`set_full_state`) before any step; and lets DeepSpeed save.

DeepSpeed creates the optimizer's state lazily at the first step, and its
``safe_set_full_*`` helpers need that state (ZeRO-1/2 link each parameter's fragments to
it; at ZeRO-3 they fail on pieces that do not divide evenly). So the state is created
here as torch's AdamW would create it, and written slice by slice into the flat tensors
DeepSpeed steps, together with the working weights the next forward uses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.strategy.checkpoint.tools.deepspeed_files import MOMENTS


def skeleton(layout: dict[str, Any]) -> nn.Module:
    """A module with the recorded parameters and persistent buffers under their names,
    in their order, tied names sharing one parameter (what DeepSpeed lays out)."""
    root = nn.Module()

    def owner(path: str) -> tuple[nn.Module, str]:
        module = root
        *parents, leaf = path.split(".")
        for part in parents:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module, leaf

    params: dict[str, nn.Parameter] = {}
    for name, shape, dtype, requires_grad in layout["parameters"]:
        module, leaf = owner(name)
        param = nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)), requires_grad)
        module.register_parameter(leaf, param)
        params[name] = param
    for alias, source in (layout.get("tied") or {}).items():
        module, leaf = owner(alias)
        module.register_parameter(leaf, params[source])
    for name, shape, dtype in layout.get("buffers", []):
        module, leaf = owner(name)
        module.register_buffer(leaf, torch.zeros(shape, dtype=getattr(torch, dtype)))
    return root


def _base_flats(engine: Any, stage: int) -> list[tuple[int, torch.Tensor]]:
    """(group index, the flat fp32 tensor the base optimizer steps) at ZeRO 1-3."""
    zero = engine.optimizer
    if stage == 3:
        return [
            (zero.sub_group_to_group_id[s], flat)
            for s, flat in enumerate(zero.fp32_partitioned_groups_flat)
        ]
    return list(enumerate(zero.single_partition_of_fp32_groups))


def _new_state(state: dict[str, Any], like: torch.Tensor, step: torch.Tensor) -> None:
    """What torch's AdamW creates lazily at its first step, with ``step`` set."""
    state["step"] = step.detach().clone().to(dtype=torch.float32, device="cpu")
    for key in MOMENTS:
        state.setdefault(key, torch.zeros_like(like, memory_format=torch.preserve_format))


def set_full_state(
    engine: Any, weights: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Write full fp32 weights and (when ``state`` is not empty) Adam's ``step``,
    ``exp_avg`` and ``exp_avg_sq`` into a DeepSpeed engine (ZeRO 0-3) before its first
    step. Every rank calls it with the same values; no collective."""
    stage = int(engine.zero_optimization_stage())
    named = dict(engine.module.named_parameters())
    names = {id(p): n for n, p in named.items()}
    zero = engine.optimizer
    base = zero if stage == 0 else zero.optimizer
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name in weights:
                buffer.copy_(weights[name])
        if stage == 0:
            for name, param in named.items():
                param.data.copy_(weights[name].view_as(param))
                if name in state:
                    _new_state(base.state[param], param, state[name]["step"])
                    for key in MOMENTS:
                        base.state[param][key].copy_(state[name][key].view_as(param))
            return
        if state:  # one flat tensor per group (ZeRO-3: per sub-group) carries the step
            for g, flat in _base_flats(engine, stage):
                step = _group_step(engine, stage, g, names, state)
                if step is not None:
                    _new_state(base.state[flat], flat, step)
        for name, param in named.items():
            if not param.requires_grad:  # outside the optimizer: set whole (or its piece)
                _set_frozen(param, weights[name])
        if stage == 3:
            _set_zero3(engine, weights, state, names)
        else:
            _set_zero12(engine, weights, state, names)


def _group_step(
    engine: Any,
    stage: int,
    group: int,
    names: dict[int, str],
    state: dict[str, dict[str, torch.Tensor]],
) -> torch.Tensor | None:
    """The step count of a group: its members' (a member that never had a gradient has
    no state); None when no member has state."""
    zero = engine.optimizer
    if stage == 3:
        members = [
            p for s, sub in enumerate(zero.fp16_groups) if zero.sub_group_to_group_id[s] == group
            for p in sub
        ]  # fmt: skip
    else:
        members = list(zero.round_robin_bit16_groups[group])
    steps = [state[names[id(p)]]["step"] for p in members if names[id(p)] in state]
    return max(steps, key=float) if steps else None


def _set_frozen(param: nn.Parameter, full: torch.Tensor) -> None:
    """A parameter no optimizer steps: its data, or at ZeRO-3 this rank's piece."""
    ds_tensor = getattr(param, "ds_tensor", None)
    if ds_tensor is None:
        param.data.copy_(full.view_as(param).to(param.dtype))
        return
    import torch.distributed as dist

    piece = ds_tensor.numel()
    flat = full.reshape(-1).to(ds_tensor.dtype)
    flat = nn.functional.pad(flat, (0, piece * dist.get_world_size() - flat.numel()))
    ds_tensor.data.copy_(flat.narrow(0, dist.get_rank() * piece, piece).view_as(ds_tensor))


def _set_zero12(
    engine: Any,
    weights: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
    names: dict[int, str],
) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero = engine.optimizer
    if state:  # link every parameter's fragments to the state just created
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    for group in zero.round_robin_bit16_groups:
        for param in group:
            name = names[id(param)]
            full = weights[name].view_as(param)
            param.data.copy_(full.to(param.dtype))  # the working copy the forward uses
            safe_set_full_fp32_param(param, full)
            if name in state:
                for key in MOMENTS:
                    safe_set_full_optimizer_state(param, state[name][key].view_as(param), key)


def _set_zero3(
    engine: Any,
    weights: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
    names: dict[int, str],
) -> None:
    zero = engine.optimizer
    base = zero.optimizer
    for s, sub in enumerate(zero.fp16_groups):
        flat = zero.fp32_partitioned_groups_flat[s]
        targets = {"fp32": flat}
        if "exp_avg" in base.state.get(flat, {}):
            targets.update({key: base.state[flat][key] for key in MOMENTS})
        world = zero.partition_count
        world = world if isinstance(world, int) else zero.sub_group_partition_counts[s]
        for param in sub:
            if getattr(param, "ds_secondary_tensor", None) is not None:
                raise NotImplementedError(
                    "converting into ZeRO-3 with hpZ (zero_hpz_partition_size > 1)"
                )
            name = names[id(param)]
            _, dest, piece = zero.grad_position[zero.get_param_id(param)]
            rank = zero._get_param_partition_rank(param)
            for key, target in targets.items():
                if key != "fp32" and name not in state:
                    continue  # never had a gradient: its moments stay zero, as AdamW's
                source = weights[name] if key == "fp32" else state[name][key]
                full = source.reshape(-1).to(target.dtype)
                full = nn.functional.pad(full, (0, piece * world - full.numel()))
                part = full.narrow(0, rank * piece, piece)
                target.narrow(0, dest, piece).copy_(part)
                if key == "fp32":  # the working partition the forward gathers
                    param.ds_tensor.data.copy_(
                        part.to(param.ds_tensor.dtype).view_as(param.ds_tensor)
                    )


def _optimizer(model: nn.Module, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    named = dict(model.named_parameters())
    if not groups:  # no optimizer state carried: one group of every trainable parameter
        groups = [{"params": [n for n, p in named.items() if p.requires_grad]}]
    built = torch.optim.AdamW([{"params": [named[n] for n in g["params"]]} for g in groups])
    for group, source in zip(built.param_groups, groups, strict=True):
        group.update({k: v for k, v in source.items() if k != "params"})
    return built


def main(argv: list[str]) -> int:
    from lightrft.strategy import get_strategy

    payload_file, tag_dir = Path(argv[0]), Path(argv[1])
    payload = torch.load(payload_file, map_location="cpu", weights_only=True, mmap=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = get_strategy(
        {
            "backend": "deepspeed",
            "zero_stage": payload["stage"],
            "device": "cpu",
            "precision": payload["precision"],
            "bf16": payload["precision"] == "bf16",
            "train_batch_size": world_size,
            "micro_train_batch_size": 1,
            "seed": 0,
        }
    )
    with strategy.init_model_context():
        model = skeleton(payload["layout"])
    optimizer = _optimizer(model, payload["groups"])
    engine, ds_optimizer, _ = strategy.prepare((model, optimizer, None))
    set_full_state(engine, payload["weights"], payload["state"])
    strategy.backend.save_state(engine, ds_optimizer, tag_dir)
    strategy.barrier()
    strategy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
