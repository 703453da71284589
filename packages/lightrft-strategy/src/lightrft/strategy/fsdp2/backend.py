"""`FSDP2Backend`: the FSDP2 backend (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightrft.strategy.backend import Backend, Triple
from lightrft.strategy.checkpoint.layout import CheckpointError
from lightrft.strategy.checkpoint.safe_io import SafeFileSystemReader
from lightrft.strategy.fsdp2.sharding import build_mesh, shard_model

if TYPE_CHECKING:
    from lightrft.strategy.world import World

logger = logging.getLogger(__name__)

DCP_DIR = "dcp"


def _first_line(exc: BaseException) -> str:
    """The cause in one line: DCP wraps each rank's error in a CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))  # (exception, traceback) per rank
        exc = cause[0] if isinstance(cause, tuple) else cause
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:500]


class FSDP2Backend(Backend):
    """FSDP2 (``fully_shard``): shards every model over a 1-D mesh (or the HSDP 2-D
    mesh when ``fsdp_shard_size`` is set), per transformer block and at the root.

    Mixed precision follows ``precision``/``bf16`` (gradients reduced in fp32);
    ``fsdp_cpu_offload`` offloads parameters to CPU. Checkpoints go through
    ``torch.distributed.checkpoint``, so a checkpoint saved at one world size loads
    at another.
    """

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.mesh: Any = None
        self._meshes: dict[int, Any] = {}
        self._layout: tuple[int | str | None, bool] | None = None  # prepare_model's

    def after_setup(self) -> None:
        self.mesh = build_mesh(self.world.world_size, self.config.fsdp_shard_size, self.device.type)
        self._meshes = {self.config.fsdp_shard_size or self.world.world_size: self.mesh}

    @contextlib.contextmanager
    def model_layout(
        self, shard_size: int | str | None, reshard_after_forward: bool | None
    ) -> Iterator[None]:
        """``prepare_model(shard_size=..., reshard_after_forward=...)``: upstream's
        values: -1 (or the world size) shards over every rank, ``n`` shards within
        groups of ``n`` ranks and replicates across them (capped at the world size),
        ``"auto"`` is upstream's rule: every rank for a model prepared for training,
        else by parameter count (under 10 B: 1, under 80 B: 8, else every rank)."""
        if shard_size is None and reshard_after_forward is None:
            yield
            return
        if reshard_after_forward is None:
            reshard_after_forward = self.config.fsdp_reshard_after_forward
        self._layout = (shard_size, reshard_after_forward)
        try:
            yield
        finally:
            self._layout = None

    def _mesh_for(self, shard_size: int | str, model: nn.Module) -> Any:
        world = self.world.world_size
        size = shard_size
        if size == "auto":
            params = sum(p.numel() for p in model.parameters())
            size = 1 if params < 10e9 else 8 if params < 80e9 else -1
        if not isinstance(size, int) or isinstance(size, bool) or size == 0 or size < -1:
            raise ValueError(
                f"prepare_model: shard_size={shard_size!r} is not a shard group size; pass "
                "a positive number of ranks, -1 for every rank, or 'auto'"
            )
        size = world if size == -1 else min(size, world)
        if world % size:
            raise ValueError(
                f"prepare_model: shard_size={shard_size!r} does not divide the world size "
                f"{world}; pass a divisor of {world} or -1 for every rank"
            )
        if size not in self._meshes:  # collective: every rank prepares the same models
            self._meshes[size] = build_mesh(world, size, self.device.type)
        return self._meshes[size]

    # -- wrapping ------------------------------------------------------------------------
    def _shard(self, model: nn.Module) -> nn.Module:
        if isinstance(model, FSDPModule):
            return model
        if self.mesh is None:
            raise RuntimeError("call strategy.setup_distributed() before preparing models")
        shard_size, reshard = self._layout or (None, self.config.fsdp_reshard_after_forward)
        mesh = self.mesh if shard_size is None else self._mesh_for(shard_size, model)
        # Built under init_model_context(meta_init=True) on some rank? Every rank prepares
        # the same models in the same order, so this agreement is one small collective.
        on_meta = any(p.is_meta for p in model.parameters())
        from_rank0 = (
            bool(self.world.all_reduce(int(on_meta), "max")) if self.world.world_size > 1 else False
        )
        rank0_state = None
        if from_rank0 and self.world.is_rank_0():
            rank0_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        shard_model(
            model,
            mesh=mesh,
            precision=self.config.resolved_precision,
            cpu_offload=self.config.fsdp_cpu_offload,
            reshard_after_forward=reshard,
            class_names=self.config.fsdp_wrap_modules,
        )
        if from_rank0:
            self._load_rank0_weights(model, rank0_state)
        return model

    def _load_rank0_weights(self, model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
        """After meta-device initialisation: allocate, then take rank 0's weights."""
        if not self.world.is_rank_0():
            # offloaded shards live on the CPU; buffers always on the compute device
            model.to_empty(device="cpu" if self.config.fsdp_cpu_offload else self.device)
            for module in model.modules():
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[key] = buffer.to(self.device)
        set_model_state_dict(
            model,
            dict(state or {}),
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        for buffer in model.buffers():  # non-persistent buffers are not in the state dict
            dist.broadcast(buffer.data, src=0)

    def model_for_optimizer(self, model: nn.Module) -> nn.Module:
        return self._shard(model)

    def prepare_train_model(self, model: nn.Module) -> nn.Module:
        return self._shard(model)

    def prepare_train(self, model: nn.Module, optimizer: Any, scheduler: Any) -> Triple:
        if isinstance(model, FSDPModule):
            return model, optimizer, scheduler
        before = {id(p): name for name, p in model.named_parameters()}
        self._shard(model)
        after = dict(model.named_parameters())
        for group in optimizer.param_groups:  # the optimizer was built before sharding
            rebound = []
            for param in group["params"]:
                name = before.get(id(param))
                if name is None or name not in after:
                    raise ValueError(
                        "the optimizer holds a parameter that is not the model's; build it "
                        "with strategy.create_optimizer(model) or over model.parameters()"
                    )
                rebound.append(after[name])
            group["params"] = rebound
        if optimizer.state:
            raise ValueError(
                "the optimizer has already stepped; prepare the model before training it"
            )
        return model, optimizer, scheduler

    def prepare_eval(self, model: nn.Module) -> nn.Module:
        self._shard(model)
        model.eval()
        return model

    def before_backward(self, model: nn.Module, is_last_micro_step: bool) -> None:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(is_last_micro_step)

    @contextlib.contextmanager
    def init_model_context(self, meta_init: bool = False) -> Iterator[None]:
        """With ``meta_init``, ranks other than 0 build models on the meta device (no
        memory); when prepared, those models are allocated and take rank 0's weights."""
        if not meta_init or self.world.world_size == 1 or self.world.is_rank_0():
            yield
        else:
            with torch.device("meta"):
                yield

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def load_full_weights(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        # every rank holds the full tensors; each keeps its own shard of them
        set_model_state_dict(
            model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def iter_full_parameters(
        self, model: nn.Module, select: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            if select is not None and not select(name):
                continue
            yield name, param.full_tensor() if isinstance(param, DTensor) else param.detach()

    def full_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None:
                full = grad.full_tensor() if isinstance(grad, DTensor) else grad.detach()
                grads[name] = full.clone()
        return grads

    def update_ema(self, model: nn.Module, model_ema: nn.Module, beta: float) -> None:
        """EMA on matching shards when both models are sharded alike, else on full
        tensors gathered from the sharded model."""
        ema_params = dict(model_ema.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name not in ema_params:
                    raise ValueError(f"moving_average: the EMA model has no parameter {name!r}")
                ema = ema_params[name]
                if isinstance(param, DTensor) and isinstance(ema, DTensor):
                    target, source = ema.to_local(), param.to_local()
                elif isinstance(param, DTensor):
                    target, source = ema.data, param.full_tensor()
                else:
                    target, source = ema.data, param.data
                target.mul_(beta).add_(source.to(target.device, target.dtype), alpha=1 - beta)

    def checkpoint_info(self) -> dict[str, Any]:
        # not needed to load (DCP reshards), but a conversion to DeepSpeed picks its
        # precision from it (DeepSpeed's files differ between fp32 and bf16)
        return {"precision": self.config.resolved_precision}

    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        # An optimizer that never stepped has no state; asking torch for its state dict
        # would initialise it with a zero-gradient step (Adam's step count would then
        # be off by one), so it is saved as "fresh" instead.
        if optimizer is not None and optimizer.state:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp_save(state, storage_writer=FileSystemWriter(directory / DCP_DIR))

    def load_state(self, model: nn.Module, optimizer: Any, directory: Path, strict: bool) -> None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        metadata = SafeFileSystemReader(directory / DCP_DIR).read_metadata()
        saved_optimizer = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
        if optimizer is not None and saved_optimizer:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        elif optimizer is not None and optimizer.state:
            optimizer.state.clear()  # the checkpoint's optimizer had never stepped
        try:
            dcp_load(
                state,
                storage_reader=SafeFileSystemReader(directory / DCP_DIR),
                planner=DefaultLoadPlanner(allow_partial_load=not strict),
            )
        # DCP reports a plan mismatch before reading any data; its CheckpointException
        # derives from BaseException, not Exception.
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"{directory} does not fit this model/optimizer ({type(model).__name__}): "
                f"{_first_line(exc)}. Load it into the model it was saved from, or pass "
                "load_module_strict=False to load only the matching weights"
            ) from exc
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        if "optim" in state:
            set_optimizer_state_dict(model, optimizer, state["optim"])
