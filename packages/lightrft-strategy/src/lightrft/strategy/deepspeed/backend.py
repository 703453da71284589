# size: the DeepSpeed backend (engine wrapping, ZeRO-3 init context, stepping, state dicts,
#   checkpoint files) in one class; its checkpoint-file and config parts live beside it
"""`DeepSpeedBackend`: the DeepSpeed backend, ZeRO stages 0-3."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from torch import nn
from torch.utils._pytree import tree_map

from lightrft.strategy import roll_call
from lightrft.strategy.actor import training_module, unwrap_model
from lightrft.strategy.backend import Backend, Triple
from lightrft.strategy.checkpoint.layout import METADATA_FILE, CheckpointError
from lightrft.strategy.deepspeed import cpu_ops, ds_config, safe_checkpoint
from lightrft.strategy.lora import lora_init_on_full_tensors
from lightrft.strategy.optim import build_adamw
from lightrft.strategy.precision import compute_dtype
from lightrft.strategy.stepping import clip_and_check, record_skip

if TYPE_CHECKING:
    from lightrft.strategy.world import World

logger = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:500]


def adapt_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Make loaded Adam state fit the optimizer that holds it now. A checkpoint written
    by another Adam (torch's AdamW on CPU; DeepSpeed's FusedAdam or CPU Adam on CUDA;
    or ``lightrft ckpt convert``) carries that optimizer's group keys and step type:
    groups gain the keys of this optimizer's defaults they lack, and ``step`` becomes a
    float32 tensor for torch's Adam/AdamW (an int there would never advance), an int for
    DeepSpeed's (their kernels take the step as an int)."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
    torch_adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None:
            continue
        if torch_adam and not torch.is_tensor(step):
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        elif not torch_adam and torch.is_tensor(step):
            state["step"] = int(step.item())


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


# DeepSpeed's FP16 optimizer wrappers (ZeRO-0 in bf16/fp16) keep fp32 master copies of
# the model's 16-bit parameters (``fp16_groups``): one per parameter (unfused,
# ``fp32_groups``) or one flat tensor per group (fused, ``fp32_groups_flat``). The
# optimizer steps those copies; DeepSpeed's safe_get_full_fp32_param does not know them.
def _fp16_wrapper_groups(wrapper: Any) -> list[list[torch.Tensor]] | None:
    """The model's parameters, grouped as the wrapper's optimizer groups; None when
    ``wrapper`` is not an FP16 wrapper."""
    if not (hasattr(wrapper, "fp32_groups") or hasattr(wrapper, "fp32_groups_flat")):
        return None
    low = getattr(wrapper, "fp16_groups", None)
    return None if low is None else [list(group) for group in low]


def _fp16_wrapper_masters(wrapper: Any) -> dict[int, torch.Tensor]:
    """``id(model parameter)`` -> its fp32 master (a view into the wrapper's live
    tensor), for an FP16 wrapper; empty for anything else."""
    groups = _fp16_wrapper_groups(wrapper) or []
    masters: dict[int, torch.Tensor] = {}
    for low, high in zip(groups, getattr(wrapper, "fp32_groups", []), strict=False):
        masters.update({id(p): q for p, q in zip(low, high, strict=False)})
    for low, flat in zip(groups, getattr(wrapper, "fp32_groups_flat", []), strict=False):
        offset = 0
        for p in low:
            masters[id(p)] = flat.narrow(0, offset, p.numel()).view(p.shape)
            offset += p.numel()
    return masters


class DeepSpeedBackend(Backend):
    """DeepSpeed: models wrapped in DeepSpeed engines, ZeRO stage ``zero_stage`` for
    training, stage 3 (or 0) evaluation engines for reference/reward/EMA models.

    The DeepSpeed configs come from :meth:`train_config` / :meth:`eval_config`
    (upstream's ``strategy.get_ds_train_config`` / ``get_ds_eval_config``; see
    :mod:`lightrft.strategy.deepspeed.ds_config` for the mapping and the
    ``deepspeed_config`` overlay). Gradient accumulation, clipping, non-finite skipping
    and scheduler stepping mean what they mean on every backend. DeepSpeed accumulates
    (its micro-step count follows the strategy's) and steps the engine's scheduler
    inside ``engine.step()``. It also clips (``gradient_clipping`` = ``max_norm``) and
    decides whether a step is skipped there, except at ZeRO stage 0 in fp32, where it
    does neither: there the backend clips itself before ``engine.step()`` and makes
    DeepSpeed skip a step whose gradient norm is not finite (see :meth:`optimizer_step`).
    """

    #: Whether setup put LOCAL_RANK in the environment (close takes it back).
    _set_local_rank: bool = False

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self._engines: weakref.WeakSet[DeepSpeedEngine] = weakref.WeakSet()
        self._hf_ds_config: Any = None  # keeps transformers' ZeRO-3 switch alive
        self._hf_zero3_failed = False

    # -- configs -------------------------------------------------------------------------
    def train_config(self) -> dict[str, Any]:
        """The DeepSpeed config of training engines (actor and critic share it)."""
        return ds_config.train_config(
            self.config,
            world_size=self.world.world_size,
            accumulation=self.world.accumulated_gradient,
            on_cuda=self.device.type == "cuda",
        )

    def eval_config(self, offload: bool = False) -> dict[str, Any]:
        """The DeepSpeed config of evaluation engines; ``offload`` keeps ZeRO-3
        parameters in CPU memory."""
        return ds_config.eval_config(
            self.config,
            world_size=self.world.world_size,
            offload=offload,
            on_cuda=self.device.type == "cuda",
        )

    def after_setup(self) -> None:
        # deepspeed.initialize insists on LOCAL_RANK, which no launcher sets for a plain
        # single process (a world of one): give it the local rank setup found, and take
        # it back at close.
        self._set_local_rank = "LOCAL_RANK" not in os.environ
        os.environ.setdefault("LOCAL_RANK", str(self.world.launch.local_rank))
        if self.device.type != "cuda":  # a C++ op only AutoTP inference uses: not built
            cpu_ops.skip_shm_comm_op()
        # DeepSpeed's communication layer wraps the process group made by the base class.
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        self.train_config()  # a bad overlay fails here, before any model is built

    # -- optimizers ----------------------------------------------------------------------
    def build_optimizer(
        self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """DeepSpeed's CPU Adam when optimizer state is offloaded, its fused Adam on
        CUDA, torch's AdamW on a CPU job (DeepSpeed's ops would need compiling there).
        All are AdamW (decoupled weight decay)."""
        if self.device.type == "cuda":
            try:
                if self.config.adam_offload and self.config.zero_stage > 0:
                    from deepspeed.ops.adam import DeepSpeedCPUAdam

                    optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(
                        groups, lr=lr, betas=betas, adamw_mode=True, **kwargs
                    )
                    return optimizer
                from deepspeed.ops.adam import FusedAdam

                optimizer = FusedAdam(groups, lr=lr, betas=betas, adam_w_mode=True, **kwargs)
                return optimizer
            except Exception as exc:  # the op failed to build on this machine
                logger.warning(
                    "DeepSpeed's Adam op is unavailable here (%s); using torch.optim.AdamW",
                    _first_line(exc),
                )
        return build_adamw(groups, lr=lr, betas=betas, **kwargs)

    # -- wrapping ------------------------------------------------------------------------
    def _engine(self, model: nn.Module, what: str) -> DeepSpeedEngine:
        model = training_module(model)  # upstream's actor: the engine is its .model
        if isinstance(model, DeepSpeedEngine):
            return model
        raise TypeError(
            f"{what} needs the DeepSpeed engine that strategy.prepare((model, optimizer, "
            f"scheduler)) returned, got {type(model).__name__}"
        )

    def _materialize(self, model: nn.Module, optimizer: Any = None) -> nn.Module:
        """After ``init_model_context(meta_init=True)`` below ZeRO-3: ranks other than 0
        allocate the model, then every rank takes rank 0's parameters and buffers. An
        optimizer built over the meta parameters is re-pointed at the allocated ones.
        Collective (every rank prepares the same models in the same order)."""
        if isinstance(model, DeepSpeedEngine):
            return cast(nn.Module, model)
        on_meta = any(p.is_meta for p in model.parameters())
        if self.world.world_size > 1:
            on_meta = bool(self.world.all_reduce(int(on_meta), "max"))
        if not on_meta:
            return model
        names = {id(p): name for name, p in model.named_parameters()}
        if not self.world.is_rank_0():
            model.to_empty(device=self.device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        if optimizer is not None:
            current = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [current[names[id(p)]] if id(p) in names else p
                                   for p in group["params"]]  # fmt: skip
        return model

    def model_for_optimizer(self, model: nn.Module) -> nn.Module:
        return self._materialize(model)

    def _cast_forward_inputs(self, model: nn.Module) -> None:
        """In bf16/fp16, cast floating-point inputs to the compute dtype as FSDP2's
        mixed precision does (DeepSpeed casts the weights, not the inputs), so the
        same training code runs on both backends."""
        dtype = compute_dtype(self.config.resolved_precision)
        if dtype is None or getattr(model, "_lightrft_casts_inputs", False):
            return

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(dtype)
            return value

        def hook(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return tree_map(cast, args), tree_map(cast, kwargs)

        model.register_forward_pre_hook(hook, with_kwargs=True)
        model._lightrft_casts_inputs = True  # type: ignore[assignment]

    def _initialize(self, model: nn.Module, config: dict[str, Any], **kwargs: Any) -> Any:
        if not dist.is_initialized():
            raise RuntimeError("call strategy.setup_distributed() before preparing models")
        self._materialize(model, kwargs.get("optimizer"))
        self._cast_forward_inputs(model)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, config=config, dist_init_required=False, **kwargs
        )
        safe_checkpoint.install(engine)
        if engine.zero_optimization_stage() == 3:  # its forward gathers parameters
            roll_call.guard_forward(engine)
        self._engines.add(engine)
        return engine, optimizer, scheduler

    def prepare_train(self, model: nn.Module, optimizer: Any, scheduler: Any) -> Triple:
        if isinstance(model, DeepSpeedEngine):
            return model, optimizer, scheduler
        if optimizer is None:
            raise ValueError(
                "prepare((model, optimizer, scheduler)) needs an optimizer: build one with "
                "strategy.create_optimizer(model)"
            )
        engine, ds_optimizer, ds_scheduler = self._initialize(
            model, self.train_config(), optimizer=optimizer, lr_scheduler=scheduler
        )
        return engine, ds_optimizer, ds_scheduler

    def prepare_train_model(self, model: nn.Module) -> nn.Module:
        # DeepSpeed wraps a training model together with its optimizer, in prepare();
        # here it is only allocated when it was built on the meta device.
        return self._materialize(model)

    def prepare_eval(self, model: nn.Module, offload: bool = False) -> nn.Module:
        if isinstance(model, DeepSpeedEngine):
            return cast(nn.Module, model)
        engine, _, _ = self._initialize(model, self.eval_config(offload=offload))
        engine.eval()
        return cast(nn.Module, engine)

    @contextlib.contextmanager
    def init_model_context(self, meta_init: bool = False) -> Iterator[None]:
        """Context in which to build models.

        At ZeRO-3, models built here are partitioned as they are built
        (``deepspeed.zero.Init``: each rank holds only its shard, rank 0's initial
        values), and transformers' ``from_pretrained`` loads straight into the shards.
        At stages 0-2 with ``meta_init``, ranks other than 0 build on the meta device
        and take rank 0's weights when the model is prepared.

        Under ZeRO-3 in bf16/fp16, parameters are created in that dtype, so their
        initialisers run in it (torch's low-precision ``uniform_`` turns a value that
        rounds to the upper bound into the lower bound): initial weights are not the
        fp32 ones rounded. Load pretrained weights, or build outside this context to
        initialise in fp32 (a full copy per rank until prepared).
        """
        if self.config.zero_stage == 3:
            train_config = self.train_config()
            self._enable_hf_zero3(train_config)
            # zero.Init replaces torch.Tensor.__new__; torch._dynamo checks that
            # signature when first imported (transformers imports it lazily while
            # building a model), so import it before the patch.
            importlib.import_module("torch._dynamo")
            # peft's LoRA start (lora_B zero) runs on gathered tensors, not empty shards
            with deepspeed.zero.Init(config_dict_or_path=train_config), lora_init_on_full_tensors():
                yield
        elif meta_init and self.world.world_size > 1 and not self.world.is_rank_0():
            with torch.device("meta"):
                yield
        else:
            yield

    def _enable_hf_zero3(self, train_config: dict[str, Any]) -> None:
        """Tell transformers (when installed) that ZeRO-3 is on, so ``from_pretrained``
        loads weights into the partitions; it stays on while this strategy lives. Made
        again on every entry: transformers keeps a weak reference to the last
        ``HfDeepSpeedConfig`` made, and other code (upstream's ``ActorLanguage`` builds
        one it drops at once) may have pointed it at a config that is gone."""
        if self._hf_zero3_failed or not importlib.util.find_spec("transformers"):
            return
        try:
            integrations = importlib.import_module("transformers.integrations")
            self._hf_ds_config = integrations.HfDeepSpeedConfig(train_config)
        except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
            self._hf_zero3_failed = True
            if not self.world.is_rank_0():
                return
            logger.warning(
                "transformers' from_pretrained will not load into ZeRO-3 partitions (%s); "
                "install accelerate for that, or build the model and load weights after",
                _first_line(exc),
            )

    # -- training steps ------------------------------------------------------------------
    def _sync_micro_steps(self, engine: DeepSpeedEngine) -> bool:
        # DeepSpeed would decide the accumulation boundary from its own micro-step count
        # and its config's fixed accumulation; ours is the one saved in checkpoints and
        # follows a planned step's micro-batches, so DeepSpeed is told the boundary.
        state = self.world.step_state(engine)
        engine.micro_steps = state.micro_steps
        closes = self.world.closes_accumulation(state)
        engine.set_gradient_accumulation_boundary(closes)
        return closes

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: Any, **kwargs: Any) -> None:
        """``engine.backward`` of ``loss / accumulation`` (the strategy scales, not
        DeepSpeed, whose accumulation is fixed in its config); gradients are reduced on
        the last micro-step (every micro-step at ZeRO-2/3)."""
        engine = self._engine(model, "backward")
        self._sync_micro_steps(engine)
        engine.backward(loss / self.world.accumulation, scale_wrt_gas=False, **kwargs)

    def _strategy_clips(self, engine: DeepSpeedEngine) -> bool:
        # DeepSpeed at stage 0 in fp32 neither reports the norm nor skips non-finite steps
        return bool(
            engine.zero_optimization_stage() == 0
            and not engine.bfloat16_enabled()
            and not engine.fp16_enabled()
        )

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        scheduler: Any = None,
        name: str = "model",
        **kwargs: Any,
    ) -> bool:
        """Count a micro-step and call ``engine.step()``; see
        :meth:`lightrft.strategy.StrategyBase.optimizer_step` for the meaning and the return value.

        At ZeRO stage 0 in fp32 (the engine's ``gradient_clipping`` is 0 there), on the
        accumulation boundary, the strategy clips the gradients to ``max_norm`` with
        ``clip_and_check`` before ``engine.step()``; when the norm is not finite it drops
        the gradients and sets the optimizer's ``overflow`` flag, so ``engine.step()``
        skips the update. At every other stage and precision DeepSpeed clips and decides
        the skip inside ``engine.step()``; the norm recorded is
        ``engine.get_global_grad_norm()`` (NaN when it reports none). Either way a step
        that ``engine.was_step_applied()`` denies is recorded as skipped.

        The engine steps the scheduler given to ``strategy.prepare``; a ``scheduler``
        passed here is stepped only when the engine has none, after an applied step.
        """
        engine = self._engine(model, "optimizer_step")
        state = self.world.step_state(engine)
        boundary = self._sync_micro_steps(engine)
        norm: float | None = None
        own = boundary and self._strategy_clips(engine)
        if own:
            params = [p for p in engine.module.parameters() if p.requires_grad]
            norm = clip_and_check(params, self.config.max_norm)
            if not math.isfinite(norm):
                for param in params:
                    param.grad = None
                engine.optimizer.overflow = True  # DeepSpeed's "skip this step" signal
        try:
            engine.step(**kwargs)
        finally:
            if own and "overflow" in vars(engine.optimizer):
                del engine.optimizer.overflow
        state.micro_steps += 1
        state.accumulated += 1
        if not boundary:
            return False
        state.accumulated = 0
        if norm is None:
            reported = engine.get_global_grad_norm()
            norm = float(reported) if reported is not None else float("nan")
        state.last_grad_norm = norm
        if not engine.was_step_applied():
            record_skip(state, norm, name)
            return False
        if engine.lr_scheduler is None and scheduler is not None:
            scheduler.step()
        state.global_steps += 1
        state.weight_changes += 1
        return True

    # -- offloading ------------------------------------------------------------------------
    def _engine_of(self, optimizer: Any) -> DeepSpeedEngine | None:
        for engine in list(self._engines):
            if engine.optimizer is optimizer or getattr(engine, "basic_optimizer", None) is (
                optimizer
            ):
                return engine
        return None

    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``engine.offload_states`` under ZeRO; nothing to do on a CPU job or with
        ``adam_offload``."""
        if self.config.adam_offload or self.device.type != "cuda":
            return
        engine = self._engine_of(optimizer)
        if engine is not None and engine.zero_optimization_stage() > 0:
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

            engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
            return
        super().offload_optimizer(optimizer)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        if self.config.adam_offload or self.device.type != "cuda":
            return
        engine = self._engine_of(optimizer)
        if engine is not None and engine.zero_optimization_stage() > 0:
            engine.reload_states()
            return
        super().load_optimizer(optimizer, device)

    def move_model(self, model: nn.Module, device: torch.device) -> None:
        """ZeRO training engines move their 16-bit parameters and gradient buffers with
        ``offload_states`` / ``reload_states``; ZeRO-3 evaluation engines move their
        parameter shards; other models move as modules."""
        from deepspeed.runtime.zero.offload_config import (
            OffloadDeviceEnum,
            OffloadStateTypeEnum,
        )

        engine: Any = model if isinstance(model, DeepSpeedEngine) else None
        stage = engine.zero_optimization_stage() if engine is not None else 0
        if stage > 0 and self._optimizer_engine(engine):
            if device.type == "cpu":
                engine.offload_states(
                    include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads],
                    device=OffloadDeviceEnum.cpu,
                )
            else:
                engine.reload_states()
        elif stage == 3:
            for param in unwrap_model(model).parameters():
                shard = getattr(param, "ds_tensor", None)
                if shard is not None:
                    shard.data = shard.data.to(device)
        else:
            super().move_model(model, device)

    @staticmethod
    def _optimizer_engine(engine: DeepSpeedEngine) -> bool:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        optimizer = getattr(engine, "optimizer", None)
        return optimizer is not None and not isinstance(optimizer, DeepSpeedZeRoOffload)

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on rank 0, tensor by tensor (ZeRO-3 partitions gathered). A
        training engine in bf16/fp16 gives its fp32 master weights, as FSDP2 does, so
        an export means the same on both backends. Collective."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = unwrap_model(model)
        masters = (
            isinstance(model, DeepSpeedEngine)
            and self.config.resolved_precision != "fp32"
            and model.optimizer is not None
        )
        rank0 = self.world.is_rank_0()
        # ZeRO-0 in bf16/fp16 keeps its masters in DeepSpeed's FP16 wrapper, which
        # DeepSpeed's safe_get_full_fp32_param does not know
        unfused = _fp16_wrapper_masters(getattr(model, "optimizer", None)) if masters else {}
        out: dict[str, torch.Tensor] = {}
        first_name: dict[int, str] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in first_name:  # tied weights stay one tensor
                if rank0:
                    out[name] = out[first_name[id(tensor)]]
                continue
            first_name[id(tensor)] = name
            full = safe_get_full_fp32_param(tensor) if masters else None
            if full is None and id(tensor) in unfused:  # the optimizer's live tensor: copied
                full = unfused[id(tensor)].detach().cpu().clone() if rank0 else None
            if full is None:
                gather = _is_partitioned(tensor)
                with deepspeed.zero.GatheredParameters([tensor], enabled=gather):
                    full = tensor.detach().cpu().clone() if rank0 else None
            if rank0 and full is not None:
                out[name] = full.detach().cpu()
        return out

    def iter_full_parameters(
        self, model: nn.Module, select: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """ZeRO-3 parameters gathered one at a time (the 16-bit copy in bf16/fp16), each
        copied out of the gather buffer (released when the next is gathered); others as
        they are."""
        for name, param in unwrap_model(model).named_parameters():
            if select is not None and not select(name):
                continue
            gather = _is_partitioned(param)
            with deepspeed.zero.GatheredParameters([param], enabled=gather):
                full = param.data.clone() if gather else param.data
            yield name, full

    def full_gradients(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """DeepSpeed's ``safe_get_full_grad`` per parameter (ZeRO-2/3 keep gradients
        in their partitions until the optimizer step)."""
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, param in unwrap_model(model).named_parameters():
            grad = safe_get_full_grad(param)
            if grad is not None:
                grads[name] = grad.detach().clone()
        return grads

    def load_full_weights(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """ZeRO-3 parameters are gathered and written back from rank 0; an engine whose
        optimizer keeps fp32 master copies (ZeRO-1/2/3, bf16/fp16) refreshes them from
        the loaded weights (in bf16/fp16 those are the loaded values rounded)."""
        module = unwrap_model(model)
        partitioned = [p for p in module.parameters() if _is_partitioned(p)]
        with deepspeed.zero.GatheredParameters(
            partitioned, modifier_rank=0, enabled=bool(partitioned)
        ):
            module.load_state_dict(state, strict=False)
        optimizer = (
            getattr(model, "optimizer", None) if isinstance(model, DeepSpeedEngine) else None
        )
        refresh = getattr(optimizer, "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    def update_ema(self, model: nn.Module, model_ema: nn.Module, beta: float) -> None:
        """Two ZeRO-3 models partitioned alike update shard by shard (no
        communication); otherwise the model's ZeRO-3 parameters are gathered (and a
        ZeRO-3 EMA model written back from rank 0)."""
        ema_params = dict(unwrap_model(model_ema).named_parameters())
        with torch.no_grad():
            for name, param in unwrap_model(model).named_parameters():
                if not param.requires_grad:
                    continue
                ema = ema_params.get(name)
                if ema is None:
                    raise ValueError(f"moving_average: the EMA model has no parameter {name!r}")
                shard = getattr(param, "ds_tensor", None)
                ema_shard = getattr(ema, "ds_tensor", None)
                if (
                    shard is not None
                    and ema_shard is not None
                    and (shard.numel() == ema_shard.numel())
                ):
                    target, source = ema_shard, shard
                    target.mul_(beta).add_(source.to(target.device, target.dtype), alpha=1 - beta)
                    continue
                fetch = [p for p in (param, ema) if _is_partitioned(p)]
                modifier = 0 if _is_partitioned(ema) else None
                with deepspeed.zero.GatheredParameters(
                    fetch, modifier_rank=modifier, enabled=bool(fetch)
                ):
                    if modifier is None or self.world.is_rank_0():
                        ema.data.mul_(beta).add_(
                            param.data.to(ema.device, ema.dtype), alpha=1 - beta
                        )

    def optimizer_param_groups(self, model: nn.Module, optimizer: Any) -> list[list[Any]] | None:
        # ZeRO-0 in bf16/fp16: the optimizer holds the FP16 wrapper's fp32 copies
        low = _fp16_wrapper_groups(getattr(model, "optimizer", None))
        if low is not None:
            return low
        return super().optimizer_param_groups(model, optimizer)

    def checkpoint_info(self) -> dict[str, Any]:
        return {"zero_stage": self.config.zero_stage, "precision": self.config.resolved_precision}

    def _check_fits(self, directory: Path) -> None:
        """ZeRO's partitioned files load only at the stage and world size that wrote them."""
        metadata = json.loads((directory / METADATA_FILE).read_text())
        stage = metadata.get("backend_info", {}).get("zero_stage")
        world = metadata.get("world_size")
        if stage is not None and stage != self.config.zero_stage:
            raise CheckpointError(
                f"{directory} was saved at ZeRO stage {stage}, this run uses zero_stage="
                f"{self.config.zero_stage}; DeepSpeed's engine files do not convert between "
                f"stages. Resume with zero_stage={stage}, or export the weights with "
                "zero_to_fp32.py (in the checkpoint directory) and start from them"
            )
        partitioned = max(stage or 0, self.config.zero_stage) > 0
        if partitioned and world is not None and world != self.world.world_size:
            raise CheckpointError(
                f"{directory} was saved at world size {world}, this run has "
                f"{self.world.world_size} ranks; ZeRO stage {self.config.zero_stage} partitions "
                f"state per rank. Resume with {world} ranks, or export the weights with "
                "zero_to_fp32.py (in the checkpoint directory) and start from them"
            )

    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None:
        """DeepSpeed's engine checkpoint, written into the tag directory itself."""
        engine = self._engine(model, "save_ckpt")
        engine.save_checkpoint(
            str(directory.parent), tag=directory.name, client_state={}, save_latest=False
        )

    def load_state(self, model: nn.Module, optimizer: Any, directory: Path, strict: bool) -> None:
        engine = self._engine(model, "load_ckpt")
        self._check_fits(directory)
        try:
            path, _ = engine.load_checkpoint(
                str(directory.parent),
                tag=directory.name,
                load_module_strict=strict,
                load_optimizer_states=optimizer is not None,
                load_lr_scheduler_states=False,  # the shared layout holds the scheduler
                load_module_only=False,  # ZeRO's weights live in its optimizer files
            )
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{directory} does not fit this model/optimizer "
                f"({type(unwrap_model(model)).__name__}, ZeRO stage "
                f"{engine.zero_optimization_stage()}, world size {self.world.world_size}): "
                f"{_first_line(exc)}. Load it into the model it was saved from, with the "
                "same ZeRO stage and world size"
            ) from exc
        if path is None:
            raise CheckpointError(
                f"DeepSpeed found no engine checkpoint in {directory}; it may be incomplete"
            )
        # ZeRO's optimizers restore the gradient clipping the checkpoint was saved with;
        # this run's configuration (max_norm) decides, as it does on every other backend.
        if hasattr(engine.optimizer, "clip_grad"):
            engine.optimizer.clip_grad = engine.gradient_clipping()
        if optimizer is not None:
            base = getattr(engine.optimizer, "optimizer", engine.optimizer)
            if isinstance(base, torch.optim.Optimizer):
                adapt_adam_state(base)

    # -- teardown ------------------------------------------------------------------------
    def destroy_process_group(self) -> None:
        """Through ``deepspeed.comm`` once DeepSpeed has used the group: DeepSpeed caches
        the groups it made (``deepspeed.utils.groups``: world clone, data parallel...)
        and its own ``destroy_process_group`` releases them. torch's alone leaves them
        behind, and the next strategy's ``deepspeed.initialize`` in the same process
        fails on the dead group ("Group ... is not registered", DeepSpeed 0.19.8)."""
        comm = sys.modules.get("deepspeed.comm.comm")  # where cdb is assigned
        if comm is not None and getattr(comm, "cdb", None) is not None:
            comm.destroy_process_group()
        else:
            dist.destroy_process_group()

    def close(self) -> None:
        """Release every engine (before the strategy leaves the process group, DeepSpeed's
        order) and take back the ``LOCAL_RANK`` setup put in the environment."""
        for engine in list(self._engines):
            engine.destroy()
        self._engines = weakref.WeakSet()
        self._hf_ds_config = None
        gc.collect()
        if self._set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
            self._set_local_rank = False
