"""save_ckpt / load_ckpt for every backend: the shared pieces around backend state.

Inside a tag directory, besides what the backend writes (``backend.save_state``):

    lightrft_checkpoint.json  metadata, written last by CheckpointDir.commit (rank 0;
                              see :mod:`lightrft.strategy.checkpoint.layout`): format,
                              tag, created_ns, sequence, backend, world_size,
                              global_step, has_optimizer, has_scheduler, backend_info,
                              lora (a LoRA model's peft adapter config, else null),
                              versions and every other file's size
    scheduler.pt              the LR scheduler's state (rank 0; only with a scheduler)
    rng/rank<r>.pt            every rank's RNG state (restored only at the same world size)
    dataloaders.json          the state of each loader from setup_dataloader, in order
                              (rank 0)
    steps.json                the model's step counters, global_steps, micro_steps and
                              accumulated (micro-steps since the last optimizer step;
                              rank 0)
    client_state.pt           the caller's client_state (plain values only; rank 0)
    rollouts/rank<r>.pt       the rollouts in flight when it was saved (engine ranks of
                              their own, max_staleness >= 1: every trainer rank's
                              outputs of the submitted prompts, collected for the
                              save), given back after a load at the same world size
    hf_config.json            the model's Hugging Face config, when it has one (rank 0;
                              what ``lightrft ckpt export`` writes as config.json)
    tokenizer/                the tokenizer's save_pretrained files, when save_ckpt was
                              given one (rank 0; what ``lightrft ckpt export`` writes
                              beside the weights; see :mod:`.tokenizer`)

The metadata's ``model`` entry lists the model's class, its parameters in order (name,
shape, dtype, requires_grad), tied names and persistent buffers, and ``optimizer`` the
optimizer's class: what ``lightrft ckpt`` needs to read or convert the checkpoint
without the model.

:class:`CheckpointManager` is built once by the strategy with what stays fixed (the
backend's state hooks, its name, the world's ranks and collectives, the config's
rotation limits); each ``save``/``load`` is handed what it saves and restores (a
:class:`CheckpointSubject`: the model, its optimizer, scheduler, step counters and the
data loaders). It knows nothing of the strategy that calls it.
``load(module_only=True)`` restores only the model's weights and returns
``client_state``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightrft.strategy.checkpoint.layout import (
    HF_CONFIG_FILE,
    CheckpointDir,
    CheckpointError,
    check_tag,
)
from lightrft.strategy.checkpoint.rng import capture_rng_state, restore_rng_state
from lightrft.strategy.checkpoint.safe_io import check_plain, load_plain, save_plain
from lightrft.strategy.checkpoint.tokenizer import check_tokenizer, write_tokenizer
from lightrft.strategy.hf_export import tied_aliases
from lightrft.strategy.lora import adapter_settings
from lightrft.strategy.tensors import full_shape

if TYPE_CHECKING:
    from lightrft.strategy.checkpoint.subject import CheckpointBackend, CheckpointSubject
    from lightrft.strategy.world import World

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    found = {"torch": str(torch.__version__)}
    for dist_name in ("lightrft-strategy", "lightrft-config", "deepspeed"):
        with contextlib.suppress(PackageNotFoundError):
            found[dist_name] = version(dist_name)
    return found


class CheckpointManager:
    """One strategy's checkpoints: ``save`` and ``load`` of a :class:`CheckpointSubject`
    under a directory of tags (see :mod:`lightrft.strategy.checkpoint.layout`)."""

    def __init__(self, backend: CheckpointBackend, backend_name: str, world: World) -> None:
        self.backend = backend
        self.backend_name = backend_name
        self.world = world

    def save(
        self,
        subject: CheckpointSubject,
        save_dir: Path,
        tag: str | None = None,
        *,
        max_num: int | None = None,
        max_gib: float | None = None,
        client_state: dict[str, Any] | None = None,
        update_latest: bool = True,
        tokenizer: Any = None,
    ) -> Path:
        """Write one complete checkpoint, tag ``tag`` (default ``global_step<N>``), then
        delete the oldest until at most ``max_num`` remain within ``max_gib`` GiB
        (defaults: the config's ``max_ckpt_num`` and ``max_ckpt_mem``); ``tokenizer``
        (when given) is saved into its ``tokenizer/`` directory. Collective."""
        config = self.world.config
        max_num = config.max_ckpt_num if max_num is None else max_num
        max_gib = config.max_ckpt_mem if max_gib is None else max_gib
        client_state = client_state or {}
        check_plain(client_state)  # fail on every rank before writing anything
        check_tokenizer(tokenizer)
        if max_num < 1:
            raise ValueError(
                f"save_ckpt max_num={max_num} must be >= 1: the newest checkpoint is kept"
            )
        backend, world = self.backend, self.world
        optimizer, scheduler = subject.optimizer, subject.scheduler
        step = subject.steps.global_steps
        tag = check_tag(tag if tag is not None else f"global_step{step}")
        rank = world.get_rank()
        ckpt = CheckpointDir(save_dir, rank=rank, barrier=world.barrier)

        held = subject.hold_rollouts()  # (waits for rollouts in flight; raises first)
        staging = ckpt.begin(tag)
        if held is not None:
            (staging / "rollouts").mkdir(exist_ok=True)
            save_plain(held, staging / "rollouts" / f"rank{rank}.pt", "rollouts in flight")
        backend.save_state(subject.model, optimizer, staging)
        (staging / "rng").mkdir(exist_ok=True)
        save_plain(capture_rng_state(), staging / "rng" / f"rank{rank}.pt", "rng state")
        failure: Exception | None = None
        if rank == 0:
            try:
                _write_rank0_pieces(subject, client_state, staging)
                write_tokenizer(tokenizer, staging)
            except Exception as exc:
                failure = exc
        # Every rank learns whether rank 0's part was written, so none waits at the commit
        # barrier for a rank that gave up; the staging directory is left, `latest` untouched.
        if not int(world.all_reduce(int(failure is None), "min")):
            if failure is not None:
                raise failure
            raise CheckpointError(f"rank 0 failed writing checkpoint {tag!r}; see rank 0's error")
        metadata = {
            "backend": self.backend_name,
            "world_size": world.world_size,
            "global_step": step,
            "has_optimizer": optimizer is not None,
            "has_scheduler": scheduler is not None,
            "backend_info": backend.checkpoint_info(),
            "versions": _versions(),
            "model": model_layout(subject.module),
            "optimizer": _qualified_name(optimizer) if optimizer is not None else None,
            "optimizer_groups": optimizer_groups(
                subject.module, backend.optimizer_param_groups(subject.model, optimizer)
            ),
            # a LoRA model's adapter config: `lightrft ckpt export` writes or merges it offline
            "lora": adapter_settings(subject.module),
        }
        final = ckpt.commit(tag, staging, metadata, update_latest=update_latest)
        ckpt.rotate(max_num, max_gib, newest=tag)
        world.barrier()
        if rank == 0:
            logger.info("saved checkpoint %s", final)
        return final

    def load(
        self,
        subject: CheckpointSubject,
        load_dir: Path,
        tag: str | None = None,
        *,
        strict: bool = True,
        optimizer: bool = True,
        scheduler: bool = True,
        module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """Verify, then restore (the optimizer's and the scheduler's states when asked);
        raises before touching any state if verification fails. Returns ``(path,
        client_state)``.

        With ``module_only`` only the model's weights are restored (and ``client_state``
        returned): no optimizer, scheduler, RNG, loader position or step counters.
        """
        backend, world = self.backend, self.world
        rank = world.get_rank()
        ckpt = CheckpointDir(load_dir, rank=rank, barrier=world.barrier)
        info = ckpt.resolve(tag, backend=self.backend_name)
        model = subject.model
        load_optimizer = optimizer and not module_only and subject.optimizer is not None
        if load_optimizer and not info.metadata.get("has_optimizer"):
            raise ValueError(
                f"{info.path} holds no optimizer state; pass load_optimizer_states=False"
            )

        client_state = load_plain(info.path / "client_state.pt")
        if module_only:
            backend.load_state(model, None, info.path, strict)
            world.barrier()
            if rank == 0:
                logger.info("loaded the model weights of checkpoint %s", info.path)
            return str(info.path), client_state
        # Loader states first: a state that does not fit raises before any model state
        # moves; a model load that fails puts the loaders back where they were (and leaves
        # no state for loaders made later), so nothing resumes from a checkpoint that did
        # not load.
        states = json.loads((info.path / "dataloaders.json").read_text())
        before = [loader.state_dict() for loader in subject.loaders]
        subject.restore_loaders(states)
        try:
            backend.load_state(
                model, subject.optimizer if load_optimizer else None, info.path, strict
            )
        except BaseException:
            subject.restore_loaders(before)
            raise
        schedule = subject.scheduler
        if scheduler and schedule is not None and (info.path / "scheduler.pt").is_file():
            schedule.load_state_dict(load_plain(info.path / "scheduler.pt"))
        _restore_rng(info.path, info.metadata.get("world_size"), rank, world.world_size)
        steps = json.loads((info.path / "steps.json").read_text())
        step_state = subject.steps
        step_state.global_steps = int(steps["global_steps"])
        step_state.micro_steps = int(steps["micro_steps"])
        # the accumulation under way (0 after an optimizer step); a planned step's
        # micro-batches need not be the config's accumulation, so micro_steps modulo it
        # is only the fallback, for checkpoints saved before the count was
        step_state.accumulated = int(
            steps.get("accumulated", step_state.micro_steps % world.accumulated_gradient)
        )
        step_state.weight_changes += 1
        subject.restore_rollouts(_held_rollouts(info.path, info.metadata, rank, world))
        world.barrier()
        if rank == 0:
            logger.info("loaded checkpoint %s", info.path)
        return str(info.path), client_state


def _restore_rng(path: Path, saved_world: Any, rank: int, world_size: int) -> None:
    """This rank's RNG state, when the checkpoint was saved at this world size and
    holds it; else a warning naming why not."""
    rng_file = path / "rng" / f"rank{rank}.pt"
    if saved_world != world_size:
        logger.warning(
            "checkpoint %s was saved at world size %s, now %d: RNG state not restored",
            path, saved_world, world_size,
        )  # fmt: skip
    elif not rng_file.is_file():
        logger.warning(
            "checkpoint %s holds no RNG state for rank %d (%s is missing): this rank's RNG "
            "state not restored", path, rank, rng_file.relative_to(path),
        )  # fmt: skip
    else:
        restore_rng_state(load_plain(rng_file))


def _held_rollouts(path: Path, metadata: dict[str, Any], rank: int, world: World) -> Any:
    """This rank's rollouts held in flight by the checkpoint, when every rank has its
    own (saved at this world size); else None (they are generated again)."""
    held = path / "rollouts" / f"rank{rank}.pt"
    every = int(world.all_reduce(int(held.is_file()), "min"))
    if not every or metadata.get("world_size") != world.world_size:
        if held.is_file() and rank == 0:
            logger.warning(
                "checkpoint %s holds the rollouts in flight for world size %s, now %d: "
                "they are generated again from the loaded weights",
                path, metadata.get("world_size"), world.world_size,
            )  # fmt: skip
        return None
    return load_plain(held)


def _qualified_name(obj: Any) -> str:
    """The user's class: past DeepSpeed's ZeRO optimizer wrapper (it holds the user's
    optimizer) and FSDP2's generated ``FSDP<Model>`` subclass."""
    inner = getattr(obj, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        obj = inner
    cls = next(
        (c for c in type(obj).__mro__ if not c.__module__.startswith("torch.distributed.fsdp")),
        type(obj),
    )
    return f"{cls.__module__}.{cls.__qualname__}"


def model_layout(model: nn.Module) -> dict[str, Any]:
    """The model's class, parameters (name, global shape, dtype, requires_grad) in
    ``named_parameters`` order, tied names (alias -> the parameter's first name) and
    persistent buffers: plain JSON, no gathering
    (a ZeRO-3 parameter's shape is its ``ds_shape``; an FSDP2 DTensor's is global)."""

    def shape(tensor: torch.Tensor) -> list[int]:
        return list(full_shape(tensor))

    buffers = []
    for module_name, module in model.named_modules():
        skipped: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in skipped:
                full = f"{module_name}.{name}" if module_name else name
                buffers.append([full, shape(buffer), str(buffer.dtype).removeprefix("torch.")])
    return {
        "class": _qualified_name(model),
        "tied": tied_aliases(model),
        "parameters": [
            [name, shape(p), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
            for name, p in model.named_parameters()
        ],
        "buffers": buffers,
    }


def optimizer_groups(model: nn.Module, groups: list[list[Any]] | None) -> list[list[str]] | None:
    """The parameter names of each optimizer group, in order, when the groups hold the
    model's own parameters (not ZeRO's flat partitions, whose files name them)."""
    if not groups:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group] for group in groups]
    except (KeyError, TypeError):
        return None


def _write_hf_config(model: nn.Module, staging: Path) -> None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json):
        (staging / HF_CONFIG_FILE).write_text(str(to_json(use_diff=False)))


def _write_rank0_pieces(
    subject: CheckpointSubject, client_state: dict[str, Any], staging: Path
) -> None:
    if subject.scheduler is not None:
        save_plain(subject.scheduler.state_dict(), staging / "scheduler.pt", "scheduler state")
    save_plain(client_state, staging / "client_state.pt", "client_state")
    _write_hf_config(subject.module, staging)
    loaders = [loader.state_dict() for loader in subject.loaders]
    (staging / "dataloaders.json").write_text(json.dumps(loaders))
    steps = {"global_steps": subject.steps.global_steps, "micro_steps": subject.steps.micro_steps,
             "accumulated": subject.steps.accumulated}  # fmt: skip
    (staging / "steps.json").write_text(json.dumps(steps))
