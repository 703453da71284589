"""Moving a checkpoint from one backend to the other, so a run resumes there.

    report = convert(open_checkpoint("ckpts"), Path("ckpts_ds"), "deepspeed", zero_stage=2)

The source is read in one process (:mod:`.offline`): full weights, and the optimizer's
state by parameter name. The target is written as that backend's own checkpoint in our
layout (:mod:`lightrft.strategy.checkpoint.layout`), with the source's scheduler,
loader, step-counter, RNG and
client state copied as they are:

- ``fsdp2``: a ``torch.distributed.checkpoint`` directory of full tensors, written in
  this process (DCP reshards on load, at any world size);
- ``deepspeed``: DeepSpeed's own engine files, written by DeepSpeed in a job of
  ``world_size`` CPU ranks (gloo) that sets the state into an engine of the target ZeRO
  stage (:mod:`lightrft.strategy.checkpoint.tools.deepspeed_files`).

Then the written tensors are read back (the same way) and compared with the source,
tensor by tensor. State that cannot be carried (an optimizer other than Adam/AdamW, for
instance) is named, and the conversion refuses unless ``drop`` names it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightrft.strategy.checkpoint.layout import (
    HF_CONFIG_FILE,
    TOKENIZER_DIR,
    CheckpointDir,
    CheckpointError,
    CheckpointInfo,
)
from lightrft.strategy.checkpoint.tools.export import Progress
from lightrft.strategy.checkpoint.tools.offline import (
    DCP_DIR,
    CheckpointContents,
    open_checkpoint,
    read_contents,
)
from lightrft.strategy.checkpoint.tools.staging import check_output, staged_output
from lightrft.strategy.checkpoint.tools.verify import Verification

TARGETS = ("fsdp2", "deepspeed")
#: the optimizer state every supported optimizer keeps per parameter
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
ADAM_CLASSES = (
    "torch.optim.adamw.AdamW",
    "torch.optim.adam.Adam",
    # DeepSpeed's own (the strategy's choice on CUDA): the same state per parameter
    "deepspeed.ops.adam.fused_adam.FusedAdam",
    "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
)
#: the pieces of a checkpoint that every backend writes alike (see .manager)
SHARED_FILES = ("scheduler.pt", "client_state.pt", "dataloaders.json", "steps.json")
DROPPABLE = ("optimizer", "rng")
PRECISIONS = ("fp32", "bf16", "fp16")


class UncarriedStateError(CheckpointError):
    """Some of the source's state cannot be carried to the target."""


@dataclass
class ConvertReport:
    output: Path
    tag: str
    target: str
    world_size: int
    dropped: list[str]
    verification: Verification


def _uncarried(contents: CheckpointContents, target_world: int) -> dict[str, str]:
    """What cannot be carried, by the name ``drop`` takes, with the reason."""
    meta = contents.info.metadata
    problems: dict[str, str] = {}
    optimizer_class = meta.get("optimizer")
    if meta.get("has_optimizer") and contents.optimizer is not None:
        if optimizer_class not in ADAM_CLASSES:
            problems["optimizer"] = (
                f"the optimizer is {optimizer_class}; only Adam/AdamW state "
                f"({', '.join(ADAM_STATE)}) is converted"
            )
        else:
            for name, state in contents.optimizer.state.items():
                unknown = sorted(set(state) - set(ADAM_STATE))
                if unknown:
                    problems["optimizer"] = (
                        f"parameter {name!r} has optimizer state {unknown} (amsgrad?); only "
                        f"{', '.join(ADAM_STATE)} are converted"
                    )
                    break
    if meta.get("world_size") != target_world:
        problems["rng"] = (
            f"the RNG states are per rank, saved by {meta.get('world_size')} ranks; the target "
            f"has {target_world}, so they cannot be restored there"
        )
    return problems


def convert(
    info: CheckpointInfo,
    out: Path,
    target: str,
    *,
    zero_stage: int | None = None,
    world_size: int | None = None,
    precision: str | None = None,
    drop: tuple[str, ...] = (),
    force: bool = False,
    progress: Progress | None = None,
    timeout: float = 1800.0,
) -> ConvertReport:
    """Convert ``info`` into a ``target`` checkpoint in the ``save_dir`` ``out`` (see the
    module's docstring). ``world_size`` defaults to the source's; ``precision`` (the
    DeepSpeed run's: its files differ between fp32 and bf16) to the source's, else fp32."""
    if target not in TARGETS:
        raise ValueError(f"--to {target!r} is not a backend this converts to; use one of {TARGETS}")
    for name in drop:
        if name not in DROPPABLE:
            raise ValueError(f"--drop {name!r}: only {', '.join(DROPPABLE)} can be dropped")
    source_meta = info.metadata
    world = int(world_size if world_size is not None else source_meta.get("world_size") or 1)
    if world < 1:
        raise ValueError(f"--world-size {world} must be >= 1")
    stage = _target_stage(target, zero_stage)
    if precision is not None and (target != "deepspeed" or precision not in PRECISIONS):
        raise ValueError(
            f"--precision {precision!r}: give one of {PRECISIONS}, with --to deepspeed only"
        )
    if "model" not in source_meta:
        raise CheckpointError(
            f"{info.path} does not record its model's parameters (saved before "
            "lightrft-strategy 0.3's `model` metadata); load it with the backend that saved "
            "it and save it again, then convert"
        )
    check_output(out, force=force, source=info.path)
    contents = read_contents(info, optimizer="optimizer" not in drop, progress=progress)
    problems = _uncarried(contents, world)
    refused = {name: why for name, why in problems.items() if name not in drop}
    if refused:
        listed = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise UncarriedStateError(
            f"cannot carry all of {info.path} to {target}: {listed}. Pass "
            + " ".join(f"--drop {name}" for name in refused)
            + " to convert without it"
        )
    if "optimizer" in drop:
        contents.optimizer = None
    dropped = sorted(name for name in problems if name in drop)
    if "optimizer" in drop and "optimizer" not in dropped and source_meta.get("has_optimizer"):
        dropped.append("optimizer")
    tag = info.tag
    with staged_output(out, force=force, source=info.path) as staging:
        ckpt = CheckpointDir(staging, rank=0, barrier=lambda: None)
        tag_dir = ckpt.begin(tag)
        if target == "fsdp2":
            write_fsdp2(contents, tag_dir)
            backend_info: dict[str, Any] = {}
        else:
            from lightrft.strategy.checkpoint.tools.deepspeed_files import write_deepspeed

            precision = precision or source_meta.get("backend_info", {}).get("precision") or "fp32"
            if stage == 0 and precision != "fp32":
                raise ValueError(
                    f"--zero-stage 0 with precision {precision}: DeepSpeed keeps that state in "
                    "its mixed-precision optimizer wrapper, which this command does not write; "
                    "convert to ZeRO stage 1-3, or pass --precision fp32"
                )
            write_deepspeed(
                contents,
                tag_dir,
                stage=stage,
                world_size=world,
                precision=precision,
                timeout=timeout,
            )
            backend_info = {"zero_stage": stage, "precision": precision}
        _copy_shared(info.path, tag_dir, copy_rng="rng" not in dropped)
        metadata = {
            key: value
            for key, value in source_meta.items()
            if key not in ("format", "tag", "created_ns", "sequence", "files")
        }
        metadata.update(
            backend=target,
            world_size=world,
            backend_info=backend_info,
            # an optimizer that never stepped has no state, and is carried as fresh
            has_optimizer=bool(source_meta.get("has_optimizer")) and "optimizer" not in drop,
            converted_from={
                "path": str(info.path),
                "backend": source_meta.get("backend"),
                "world_size": source_meta.get("world_size"),
                "backend_info": source_meta.get("backend_info", {}),
                "dropped": dropped,
            },
        )
        ckpt.commit(tag, tag_dir, metadata)
        verification = verify_conversion(contents, staging, progress)
        verification.raise_if_failed(f"the conversion of {info.path}")
    return ConvertReport(out.absolute(), tag, target, world, dropped, verification)


def _target_stage(target: str, zero_stage: int | None) -> int:
    if target == "fsdp2":
        if zero_stage is not None:
            raise ValueError("--zero-stage applies to --to deepspeed only")
        return 0
    if zero_stage is None:
        raise ValueError("--to deepspeed needs --zero-stage (0, 1, 2 or 3)")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    return zero_stage


def _copy_shared(source: Path, tag_dir: Path, *, copy_rng: bool) -> None:
    for name in (*SHARED_FILES, HF_CONFIG_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, tag_dir / name)
    for per_rank in ("rng", "rollouts") if copy_rng else ():  # (saved for the same world)
        if (source / per_rank).is_dir():
            shutil.copytree(source / per_rank, tag_dir / per_rank, dirs_exist_ok=True)
    if (source / TOKENIZER_DIR).is_dir():
        shutil.copytree(source / TOKENIZER_DIR, tag_dir / TOKENIZER_DIR, dirs_exist_ok=True)


# -- FSDP2 target -----------------------------------------------------------------------


def _optimizer_state_dict(contents: CheckpointContents) -> dict[str, Any] | None:
    """The optimizer state in the form FSDP2's ``get_optimizer_state_dict`` gives:
    keyed by parameter name, ``step`` a float32 scalar tensor."""
    if contents.optimizer is None:
        return None
    state = {}
    for name, values in contents.optimizer.state.items():
        entry = {k: v for k, v in values.items() if k != "step"}
        entry["step"] = torch.tensor(float(values["step"]), dtype=torch.float32)
        state[name] = entry
    groups = [dict(group) for group in contents.optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def write_fsdp2(contents: CheckpointContents, tag_dir: Path) -> None:
    """The FSDP2 backend's files for ``contents``: one DCP checkpoint of full tensors."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state: dict[str, Any] = {"model": dict(contents.weights)}
    optimizer = _optimizer_state_dict(contents)
    if optimizer is not None:
        state["optim"] = optimizer
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp_save(state, storage_writer=FileSystemWriter(tag_dir / DCP_DIR), no_dist=True)


# -- verification -----------------------------------------------------------------------


def verify_conversion(
    source: CheckpointContents, staging: Path, progress: Progress | None
) -> Verification:
    """Read the written checkpoint back as a reader of its backend would, and compare
    every weight and optimizer tensor with the source."""
    written = read_contents(open_checkpoint(staging), optimizer=source.optimizer is not None)
    verification = Verification()
    total = len(source.weights) + (len(source.optimizer.state) if source.optimizer else 0)
    done = 0
    for name, tensor in source.weights.items():
        verification.check(f"weight {name}", tensor, written.weights.get(name))
        done += 1
        if progress is not None:
            progress("verify", done, total)
    verification.extra(f"weight {n}" for n in sorted(set(written.weights) - set(source.weights)))
    if source.optimizer is not None:
        got = written.optimizer.state if written.optimizer is not None else {}
        for name, values in source.optimizer.state.items():
            for key, value in values.items():
                actual = got.get(name, {}).get(key)
                if key == "step":  # each backend keeps the count in its own dtype
                    value = torch.tensor(float(value))
                    actual = None if actual is None else torch.tensor(float(actual))
                verification.check(f"optimizer {name}.{key}", value, actual)
            done += 1
            if progress is not None:
                progress("verify", done, total)
    return verification
