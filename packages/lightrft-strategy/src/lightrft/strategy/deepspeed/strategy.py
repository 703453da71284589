"""`DeepspeedStrategy`: StrategyBase over DeepSpeed engines, ZeRO stages 0-3."""

from __future__ import annotations

from typing import Any

from lightrft.strategy.base import StrategyBase
from lightrft.strategy.construction import BASE_PARAMETERS
from lightrft.strategy.deepspeed.backend import DeepSpeedBackend, adapt_adam_state

__all__ = ["DeepspeedStrategy", "adapt_adam_state"]


class DeepspeedStrategy(StrategyBase):
    """A strategy whose backend is
    :class:`~lightrft.strategy.deepspeed.backend.DeepSpeedBackend`: models wrapped in
    DeepSpeed engines, ZeRO stage ``zero_stage`` for training, stage 3 (or 0) evaluation
    engines for reference/reward/EMA models.

    Differences from FSDP2 that training code can see: ``prepare_model(m,
    is_training=True)`` returns ``m`` unchanged (DeepSpeed wraps a training model
    together with its optimizer, in :meth:`prepare`); checkpoints hold DeepSpeed's own
    engine files, so ZeRO optimizer state loads at the world size it was saved at.
    """

    backend_name = "deepspeed"
    backend_class = DeepSpeedBackend
    backend: DeepSpeedBackend
    #: ``DeepspeedStrategy(seed, max_norm, micro_train_batch_size, train_batch_size,
    #: zero_stage, bf16, args)`` as upstream.
    upstream_parameters = (*BASE_PARAMETERS[:-1], "zero_stage", "bf16", "args")

    @property
    def stage(self) -> int:
        """The ZeRO stage (upstream's attribute name)."""
        return self.config.zero_stage

    def get_ds_train_config(self, is_actor: bool = True) -> dict[str, Any]:
        """The DeepSpeed config of training engines (``is_actor`` kept for upstream
        callers; actor and critic engines share it)."""
        del is_actor
        return self.backend.train_config()

    def get_ds_eval_config(self, offload: bool = False) -> dict[str, Any]:
        """The DeepSpeed config of evaluation engines; ``offload`` keeps ZeRO-3
        parameters in CPU memory."""
        return self.backend.eval_config(offload)
