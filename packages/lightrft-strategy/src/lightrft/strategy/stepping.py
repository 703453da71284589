"""Gradient accumulation, clipping and non-finite skipping: one meaning for every backend.

Per model (an actor and a critic never share state):

* ``backward`` scales the loss by ``1 / accumulation_steps``;
* ``optimizer_step`` counts micro-steps and acts on every ``accumulation_steps``-th
  (``accumulation_steps`` is the config's, or the number of micro-batches of the step
  a :class:`~lightrft.strategy.micro_batches.StepPlan` planned):
  it computes the global gradient norm over the model's parameters, skips the step
  (zeroing gradients, not advancing the scheduler) when that norm is not finite,
  clips to ``max_norm`` when ``max_norm > 0``, steps the optimizer and the scheduler,
  and zeroes the gradients.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class StepState:
    """Counters of one model's optimisation."""

    micro_steps: int = 0
    #: Micro-steps since the last optimizer step (the accumulation under way).
    accumulated: int = 0
    global_steps: int = 0
    skipped_steps: int = 0
    last_grad_norm: float | None = None
    #: Times the strategy changed the weights: optimizer steps applied, loads
    #: (``load_model``, ``load_ckpt``) and EMA updates. A weight sync that finds the
    #: number unchanged since its last one knows the engine holds these weights.
    weight_changes: int = 0


class StepStates:
    """``StepState`` per model, held weakly so a dropped model frees its entry."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[nn.Module, StepState] = weakref.WeakKeyDictionary()

    def __getitem__(self, model: nn.Module) -> StepState:
        state = self._states.get(model)
        if state is None:
            state = self._states[model] = StepState()
        return state

    def unfinished(self) -> int:
        """Micro-steps run, over every model, since each one's last optimizer step."""
        return sum(state.accumulated for state in self._states.values())


def record_skip(state: StepState, norm: float, name: str) -> None:
    """Count and report an optimizer step skipped for a non-finite gradient norm."""
    state.skipped_steps += 1
    logger.warning(
        "%s: gradient norm is %s at step %d; skipping this optimizer step",
        name,
        norm,
        state.global_steps + 1,
    )


def clip_and_check(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Return the 2-norm of all gradients together (for sharded DTensor gradients, the
    global norm over every rank's shard); clip to ``max_norm`` when it is finite and
    ``max_norm > 0``."""
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad:
        return 0.0
    grads = [p.grad for p in with_grad if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    full_tensor = getattr(norm, "full_tensor", None)
    value = float(full_tensor() if callable(full_tensor) else norm)
    if max_norm > 0 and math.isfinite(value):
        # the norm stays a DTensor here when the gradients are DTensors
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
    return value
