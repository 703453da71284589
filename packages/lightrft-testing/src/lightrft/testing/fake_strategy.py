"""`FakeStrategy`: the whole `StrategyBase` interface in one process, for tests.

It is the real base class with the thinnest backend: models are not sharded, so
everything the base class defines (accumulation, clipping, non-finite skipping,
schedules, collectives, the resumable loader, the checkpoint layout, rotation, resume,
HF export, engine calls) behaves as on FSDP2 or DeepSpeed at world size 1. Prepared
models compute in the configured precision as FSDP2 does (``bf16=True``, the default:
bf16 forward with fp32 master weights and fp32 gradients; see
:mod:`lightrft.testing.mixed_precision`); ``precision="fp32"`` (or ``bf16=False``)
trains in fp32.

Where it differs from the real backends:

* it runs on the CPU unless ``device="cuda"`` is set (``auto`` means CPU here);
* prepared models stay the objects given (``prepare(model)`` returns ``model``, as
  upstream's fake); in bf16/fp16 forward hooks make them compute in that precision
  (:mod:`lightrft.testing.mixed_precision`); bf16 runs agree with FSDP2's closely, not
  bit for bit (where and in which dtype gradients are accumulated differs);
* production parallel sizes (``sp_size``, ``engine_tp_size`` above 1) are accepted
  and simulated: the process is one data-parallel rank whose sequence-parallel and
  engine groups are itself (logged once at setup), so a trainer's unit test can use its
  real arguments; so is ``engine_placement: separate`` (with ``engine_ranks`` and
  ``max_staleness``): the engine is this process's, and ``collect_generation``
  generates from the newest weights (``rollout_lag`` 0);
* ``setup_inference_engine()`` with nothing to build from (upstream's fake test calls
  ``setup_inference_engine(None)``) sets up a :class:`~lightrft.testing.FakeEngine`;
  ``engine_generate_local`` with no prompts returns ``[]``;
* it never creates a process group and ignores torchrun/SLURM variables: its world is
  one rank (``world_size`` 1, rank 0; without a process group, collectives return what
  a world-size-1 run returns);
* ``init_model_context(meta_init=True)`` builds normally (there is no other rank to
  copy weights from);
* its checkpoints hold the model and optimizer ``state_dict`` as two files
  (``model.pt``, ``optim.pt``, read with ``weights_only=True``) instead of DCP shards or
  DeepSpeed engine files, so they load only into a FakeStrategy.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightrft.strategy import StrategyBase
from lightrft.strategy import distributed as _distributed
from lightrft.strategy.actor import unwrap_model
from lightrft.strategy.backend import Backend, Triple
from lightrft.strategy.checkpoint.layout import CheckpointError
from lightrft.strategy.checkpoint.safe_io import load_plain, save_plain
from lightrft.testing.mixed_precision import with_compute_precision

logger = logging.getLogger("lightrft.testing")
#: Sizes the fake accepts above 1 and simulates in its one process.
SIMULATED_SIZES = ("sp_size", "engine_tp_size")


class FakeBackend(Backend):
    """The fake's backend: models are not sharded; checkpoints hold ``model.pt`` and
    ``optim.pt``."""

    # -- wrapping: none ------------------------------------------------------------------
    def _wrap(self, model: nn.Module) -> nn.Module:
        """On the device, computing in the configured precision (fp32 masters)."""
        return with_compute_precision(model.to(self.device), self.config.resolved_precision)

    def prepare_train(self, model: nn.Module, optimizer: Any, scheduler: Any) -> Triple:
        return self._wrap(model), optimizer, scheduler

    def prepare_train_model(self, model: nn.Module) -> nn.Module:
        return self._wrap(model)

    def prepare_eval(self, model: nn.Module) -> nn.Module:
        return self._wrap(model).eval()

    @contextlib.contextmanager
    def init_model_context(self, meta_init: bool = False) -> Iterator[None]:
        """Builds normally (``meta_init`` has no other rank to take weights from)."""
        del meta_init
        yield

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        module = unwrap_model(model)
        return {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}

    def update_ema(self, model: nn.Module, model_ema: nn.Module, beta: float) -> None:
        ema_params = dict(unwrap_model(model_ema).named_parameters())
        with torch.no_grad():
            for name, param in unwrap_model(model).named_parameters():
                if name not in ema_params:
                    raise ValueError(f"moving_average: the EMA model has no parameter {name!r}")
                ema = ema_params[name]
                ema.data.mul_(beta).add_(param.data.to(ema.device, ema.dtype), alpha=1 - beta)

    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None:
        save_plain(self.full_state_dict(model), directory / "model.pt", "model state")
        if optimizer is not None:
            save_plain(optimizer.state_dict(), directory / "optim.pt", "optimizer state")

    def load_state(self, model: nn.Module, optimizer: Any, directory: Path, strict: bool) -> None:
        module = unwrap_model(model)
        state = load_plain(directory / "model.pt")
        try:
            module.load_state_dict(state, strict=strict)
        except RuntimeError as exc:
            first = " ".join(str(exc).split())[:400]
            raise CheckpointError(
                f"{directory} does not fit this model ({type(module).__name__}): {first}. "
                "Load it into the model it was saved from, or pass "
                "load_module_strict=False to load only the matching weights"
            ) from exc
        if optimizer is not None and (directory / "optim.pt").is_file():
            optimizer.load_state_dict(load_plain(directory / "optim.pt"))


class FakeStrategy(StrategyBase):
    """A single-process strategy with no process group and no GPU needed.

    ``FakeStrategy(seed, max_norm, micro_train_batch_size, train_batch_size, args)`` as
    upstream, or ``FakeStrategy(config, **overrides)``; the four numbers, when given,
    win over ``args`` (a namespace, mapping or :class:`StrategyConfig`), and
    ``overrides`` win over everything. Like every strategy it is ready when built
    (seeded, ``accumulated_gradient`` known) unless ``defer_setup=True``.
    """

    backend_name = "fake"
    backend_class = FakeBackend

    def __init__(self, *positional: Any, **overrides: Any) -> None:
        super().__init__(*positional, **{**overrides, "backend": "fake"})
        self.world.alone = True  # also before setup_distributed (defer_setup=True)

    # -- setup -----------------------------------------------------------------------------
    def setup_distributed(
        self, timeout: datetime.timedelta | None = None, num_gpu_per_node: int | None = None
    ) -> None:
        """A world of one, without a process group; picks the device, seeds. Again on a
        ready strategy: nothing changes."""
        del timeout, num_gpu_per_node
        if self.is_ready:
            return
        # a world of one whatever torchrun/SLURM variables or a process group say
        self.world.alone = True
        launch = _distributed.LaunchEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
        # CPU unless CUDA is asked for by name ("auto" stays on the CPU: no GPU needed)
        device = _distributed.resolve_device("cuda" if self.config.device == "cuda" else "cpu")
        sizes = {k: getattr(self.config, k) for k in SIMULATED_SIZES}
        simulated = {k: v for k, v in sizes.items() if v > 1}
        update: dict[str, Any] = dict.fromkeys(simulated, 1)
        if self.config.engine_placement == "separate":
            # the engine is in this process: generation happens at collect_generation
            update.update(engine_placement="colocated", engine_ranks=None, max_staleness=0)
            simulated |= {"engine_placement": "separate"}
        self.world.sizes = self.config.model_copy(update=update)
        if simulated:
            logger.info(
                "FakeStrategy: %s simulated in one process (it is one data-parallel rank; "
                "its sequence-parallel and engine groups are itself; an engine of its "
                "own is this process's, generating at collect_generation: weight_lag 0)",
                ", ".join(f"{k}={v}" for k, v in simulated.items()),
            )
        self.world.sizes.validate_world_size(1)
        self._finish_setup(launch, device)

    # -- engines ---------------------------------------------------------------------------
    def setup_inference_engine(
        self,
        engine: Any = None,
        engine_type: str | None = None,
        actor: nn.Module | None = None,
        **engine_options: Any,
    ) -> Any:
        """As :meth:`StrategyBase.setup_inference_engine`; called with nothing to build
        from (no engine, no ``engine_type``, none configured beyond the default) it sets
        up a :class:`~lightrft.testing.FakeEngine` instead of failing, as upstream's fake
        carries on."""
        if (
            engine is None
            and engine_type is None
            and not engine_options
            and ("engine_type" not in self.config.model_fields_set)
        ):
            from lightrft.testing.fake_engine import FakeEngine

            logger.info("FakeStrategy: no engine configured; setting up a FakeEngine")
            engine = FakeEngine()
        return super().setup_inference_engine(engine, engine_type, actor, **engine_options)

    def engine_generate_local(
        self,
        sampling_params: Any,
        prompt_token_ids: Any = None,
        multi_modal_inputs: Any = None,
    ) -> list[Any]:
        """As :meth:`StrategyBase.engine_generate_local`; with no prompts at all, ``[]``
        (upstream's fake answers every call so)."""
        if prompt_token_ids is None and multi_modal_inputs is None:
            return []
        return super().engine_generate_local(sampling_params, prompt_token_ids, multi_modal_inputs)


def get_fake_strategy(
    args: Any = None, *, defer_setup: bool = False, **overrides: Any
) -> FakeStrategy:
    """A ready :class:`FakeStrategy` from ``args`` (namespace, mapping, config or None)."""
    return FakeStrategy(args=args, defer_setup=defer_setup, **overrides)
