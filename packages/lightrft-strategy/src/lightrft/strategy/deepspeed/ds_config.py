"""The DeepSpeed configs handed to ``deepspeed.initialize``, built in one place.

No DeepSpeed import here: the configs are plain dicts, inspectable (and testable)
without the extra. :class:`DeepspeedStrategy` exposes them as ``get_ds_train_config``
and ``get_ds_eval_config``.

How :class:`~lightrft.config.StrategyConfig` maps onto DeepSpeed keys:

================================  =====================================================
StrategyConfig                    DeepSpeed
================================  =====================================================
``zero_stage``                    ``zero_optimization.stage`` (evaluation engines: 3
                                  when training uses 3, else 0)
``precision`` / ``bf16``          ``bf16.enabled`` or ``fp16.enabled`` (fp32: neither)
``max_norm``                      ``gradient_clipping`` (0 when ``max_norm <= 0``; also
                                  0 at stage 0 in fp32, where the strategy clips and
                                  checks the norm itself, see below)
``micro_train_batch_size``        ``train_micro_batch_size_per_gpu``
accumulation steps                ``gradient_accumulation_steps`` =
                                  ``train_batch_size / (micro x data-parallel ranks)``
                                  (``config.gradient_accumulation_steps(world_size)``)
(derived)                         ``train_batch_size`` = micro x accumulation x ranks
``zpg``                           ``zero_optimization.zero_hpz_partition_size``
``overlap_comm``                  ``zero_optimization.overlap_comm``
``grad_accum_dtype``              ``data_types.grad_accum_dtype``
``adam_offload``                  ``zero_optimization.offload_optimizer.device = cpu``
                                  (on CUDA at stages 1-3; on a CPU job optimizer state
                                  is in CPU memory already)
``deepspeed_config``              overlaid last (deep merge)
================================  =====================================================

DeepSpeed at stage 0 in fp32 neither reports the gradient norm nor skips a step whose
gradients are not finite (every other stage/precision does both), so there the
strategy clips with torch's ``clip_grads_with_norm_`` and skips non-finite steps
itself; the meaning is the same on every stage.

The overlay may add or change any other key, but the keys the strategy derives must
agree with it (a disagreement raises :class:`~lightrft.config.ConfigError` naming
the key, both values and the field to change), and ``optimizer`` / ``scheduler``
sections are refused: the strategy's optimizer and schedule are the ones used.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from lightrft.config import ConfigError, StrategyConfig
from lightrft.config.deepspeed_rules import adam_offload_problem, derived_keys, overlay_problems
from lightrft.config.errors import ConfigProblem

#: DeepSpeed steps_per_print: progress lines are left to the training loop.
_NEVER = None


def _problem(value: Any, message: str, accepted: str | None = None) -> ConfigError:
    return ConfigError([ConfigProblem("deepspeed_config", value, message, accepted)])


def read_overlay(config: StrategyConfig) -> dict[str, Any]:
    """``config.deepspeed_config`` as a dict (reading the JSON file when it is a path)."""
    value = config.deepspeed_config
    if value is None:
        return {}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _problem(
            value,
            f"cannot read the DeepSpeed JSON file ({exc.strerror or exc})",
            "an existing .json file, a mapping, or JSON object text",
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _problem(
            value, f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})", "a JSON object"
        ) from None
    if not isinstance(data, dict):
        raise _problem(value, f"{path} holds a {type(data).__name__}, not an object")
    return data


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def precision_keys(precision: str) -> dict[str, Any]:
    return {
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }


def train_config(
    config: StrategyConfig,
    *,
    world_size: int,
    accumulation: int,
    on_cuda: bool,
) -> dict[str, Any]:
    """The config of training engines (see the module docstring for the mapping)."""
    stage = config.zero_stage
    precision = config.resolved_precision
    clip = config.max_norm if config.max_norm > 0 else 0.0
    strategy_clips = stage == 0 and precision == "fp32"
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": config.overlap_comm}
    if stage == 3:
        zero["zero_hpz_partition_size"] = config.zpg
    if config.adam_offload:
        problem = adam_offload_problem(config.adam_offload, stage)
        if problem is not None:
            raise ConfigError([problem])
        if on_cuda:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_train_batch_size,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed counts every rank as data-parallel (sequence-parallel ranks too)
        "train_batch_size": config.micro_train_batch_size * accumulation * world_size,
        "gradient_clipping": 0.0 if strategy_clips else clip,
        "zero_optimization": zero,
        **precision_keys(precision),
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
        "prescale_gradients": False,
    }
    if precision == "fp16":
        ds["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if config.grad_accum_dtype is not None:
        ds["data_types"] = {"grad_accum_dtype": config.grad_accum_dtype}
    overlay = read_overlay(config)
    batch_fix = (
        f"it follows train_batch_size={config.train_batch_size}, "
        f"micro_train_batch_size={config.micro_train_batch_size} and {world_size} ranks "
        f"(sp_size={config.sp_size}); change those instead"
    )
    derived = derived_keys(config)
    derived["gradient_accumulation_steps"] = (accumulation, batch_fix)
    derived["train_batch_size"] = (ds["train_batch_size"], batch_fix)
    problems = overlay_problems(overlay, derived)
    if problems:
        raise ConfigError(problems)
    if strategy_clips and "gradient_clipping" in overlay:
        overlay = {k: v for k, v in overlay.items() if k != "gradient_clipping"}
    return _merge(ds, overlay)


def eval_config(
    config: StrategyConfig, *, world_size: int, offload: bool, on_cuda: bool
) -> dict[str, Any]:
    """The config of evaluation engines (reference, reward, EMA models): ZeRO-3 when
    training uses ZeRO-3 (parameters stay partitioned), else stage 0; ``offload`` puts
    ZeRO-3 parameters in CPU memory. The overlay applies except for the keys that
    only concern training (batch sizes, accumulation, clipping, stage)."""
    stage = 3 if config.zero_stage == 3 else 0
    zero: dict[str, Any] = {"stage": stage}
    if offload and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_train_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": config.micro_train_batch_size * world_size,
        "zero_optimization": zero,
        **precision_keys(config.resolved_precision),
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    overlay = read_overlay(config)
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "optimizer",
        "scheduler",
    ):
        overlay.pop(key, None)
    if isinstance(overlay.get("zero_optimization"), dict):
        overlay["zero_optimization"] = {
            k: v
            for k, v in overlay["zero_optimization"].items()
            if k not in ("stage", "offload_optimizer")
        }
    return _merge(ds, overlay)
