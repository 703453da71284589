# size: one pydantic model: its 67 fields (upstream's names where its config.py has them, 43
#   at 49e62cb), their descriptions and the validators that join them, read together
"""`StrategyConfig`: the settings of a LightRFT training strategy, typed and checked.

Field names and defaults are upstream LightRFT's, so an existing argparse namespace
converts unchanged; fields upstream lacked are marked "(new)" in their descriptions.

Which fields are read, and where (modules of ``lightrft.strategy`` unless named):

* this module: ``validate_world_size`` / ``gradient_accumulation_steps`` (train_batch_size,
  micro_train_batch_size, sp_size, engine_tp_size, zpg, fsdp_shard_size);
  ``resolved_backend`` (backend, fsdp), ``resolved_precision`` (precision, bf16),
  ``sleep_level`` (enable_engine_sleep, engine_sleep_level).
* ``registry``: the backend to build (``resolved_backend``).
* ``base`` (every backend): seed, device, dist_timeout_s, max_norm, micro_train_batch_size, sp_size,
  actor_learning_rate, critic_learning_rate, adam_betas, l2, adam_offload; it mirrors
  train_batch_size, bf16, zpg, grad_accum_dtype, overlap_comm and engine_type as
  upstream's read-only strategy attributes.
* ``optim``: lr_scheduler, lr_warmup_ratio, min_lr_ratio.
* ``engine_link``: engine_tp_size, ``sleep_level``, verify_engine_sync,
  ``resolved_precision`` (the tolerance of ``verify_engine_weights``); it builds the
  engine with lightrft-engines' ``build_engine``, which reads engine_type,
  engine_tp_size, engine_mem_util, engine_max_model_len, precision/bf16, seed, device,
  the sleep fields, and the extras ``pretrain`` (the model), ``prompt_max_len`` +
  ``generate_max_len`` and ``engine_options``.
* ``base`` with ``sequence_parallel`` and ``ulysses``: sp_size (the groups, the
  sequence split, the data-parallel sampler).
* ``base`` (``save_ckpt``, for the checkpoint manager): max_ckpt_num, max_ckpt_mem.
* ``base`` with ``micro_batches`` (``plan_micro_batches``): packing_samples,
  max_tokens_per_gpu, loss_agg_mode, sp_size.
* ``lora`` (``apply_lora``): lora_rank, lora_alpha, lora_dropout, target_modules;
  ``engine_link`` and ``build_engine``: lora_sync (with lora_rank, target_modules).
* ``deepspeed`` (``strategy``, ``ds_config``): zero_stage, precision/bf16, max_norm,
  micro_train_batch_size, train_batch_size, sp_size, zpg, overlap_comm,
  grad_accum_dtype, adam_offload, deepspeed_config.
* ``fsdp2``: precision/bf16, fsdp_shard_size, fsdp_wrap_modules,
  fsdp_reshard_after_forward, fsdp_cpu_offload.
* ``lightrft.testing``: ``FakeStrategy`` reads device (and the base's fields),
  ``spec_examples`` bf16.

Kept only so that upstream callers' namespaces convert unchanged (no code
here reads them; a training loop may): local_rank (the launcher's LOCAL_RANK or
SLURM_LOCALID is used), critic_pretrain, remote_rm_url, pretrain_data,
fused_linear_logprob, reward_running_norm, reward_running_norm_minus_mean,
advantages_norm, advantage_clip, reward_clip, micro_rollout_batch_size,
n_samples_per_prompt, overlong_buffer, overlong_buffer_len,
overlong_buffer_penalty_factor, dynamic_sampling, advantage_estimator, use_kl_loss,
kl_estimator, mixed_mm_data, use_mp_opt, plot_every, use_tensorboard.

Checks that need no world size run at construction (and on assignment), those of
DeepSpeed only when it is the backend in force; :meth:`StrategyConfig.validate_world_size`
holds the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lightrft.config import sources, summary
from lightrft.config.backends import (
    BUILTIN_BACKENDS,
    BUILTIN_ENGINES,
    canonical_backend_name,
    known_backend_names,
    known_engine_names,
)
from lightrft.config.deepspeed_rules import adam_offload_problem, derived_keys, overlay_problems
from lightrft.config.errors import ConfigError, ConfigProblem, from_validation_error
from lightrft.config.placement import engine_ranks_problems, placement_problems
from lightrft.config.spelling import closest, one_edit_away

logger = logging.getLogger("lightrft.config")


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads True as 1; for a size or a rate that is always a mistake.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "a boolean is not accepted as a number")
    return value


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def _flag_or_path(value: Any) -> Any:
    # Upstream stores either a flag or a path in these fields (argparse gives a path or None).
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, Path):
        return str(value)
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool), AllowInfNan(False)]
Beta = Annotated[float, BeforeValidator(_not_bool), Field(ge=0.0, lt=1.0)]
FlagOrPath = Annotated[bool | str, BeforeValidator(_flag_or_path)]


def _json_or_path(value: Any) -> Any:
    # A mapping, a path to a JSON file, or JSON text (from a flag or the environment).
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise PydanticCustomError(
                "json_invalid", "not valid JSON ({msg})", {"msg": exc.msg}
            ) from None
    return value


JsonOrPath = Annotated[dict[str, Any] | str, BeforeValidator(_json_or_path)]


def _joined(field: str, value: Any, message: str, fix: str) -> ConfigProblem:
    """A problem of a rule joining fields, named by the field to change first."""
    return ConfigProblem(field, value, message, fix=fix)


def _cross_field(problems: list[ConfigProblem]) -> PydanticCustomError:
    # One pydantic error carrying every problem, structured: errors.py lists them one by
    # one with their fields, and the command reports each field, value, source and fix.
    return PydanticCustomError(
        "lightrft_cross_field",
        "{joined}",
        {"joined": "; ".join(map(str, problems)), "items": problems},
    )


class StrategyConfig(BaseModel):
    """Configuration of a LightRFT training strategy.

    Build it directly (unknown keyword names are an error), or leniently from an
    argparse namespace, a mapping or any object with :meth:`from_args` (unknown names
    go to ``extra_args``), or layered from a file, the environment and command-line
    flags with :meth:`load` / :meth:`from_argv`.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # -- basic ---------------------------------------------------------------------
    seed: Int = Field(42, ge=0, lt=2**32, description="Random seed for python, numpy and torch.")
    max_norm: Float = Field(
        1.0, description="Global gradient-norm clipping threshold; a value <= 0 disables clipping."
    )
    micro_train_batch_size: Int = Field(1, gt=0, description="Samples per rank per forward pass.")
    train_batch_size: Int = Field(
        128, gt=0, description="Samples per optimizer step over all ranks (global batch)."
    )
    bf16: bool = Field(True, description="Train in bfloat16 mixed precision.")

    # -- DeepSpeed / FSDP ----------------------------------------------------------
    zero_stage: Int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    fsdp: bool = Field(False, description="Use the FSDP2 backend (upstream switch; see backend).")
    fsdp_cpu_offload: bool = Field(False, description="FSDP2: offload parameters to CPU.")

    # -- distributed ---------------------------------------------------------------
    adam_offload: bool = Field(
        False, description="Keep optimizer state on the CPU (DeepSpeed: needs zero_stage >= 1)."
    )
    zpg: Int = Field(1, gt=0, description="DeepSpeed ZeRO++ hierarchical partition size.")
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="Dtype of gradient accumulation buffers (None: the backend default)."
    )
    overlap_comm: bool = Field(False, description="Overlap gradient reduction with backward.")
    deepspeed_config: JsonOrPath | None = Field(
        None,
        description="(new) DeepSpeed settings overlaid on the generated train/eval configs: "
        "a mapping, JSON text or a path to a JSON file. Keys the strategy derives (batch "
        "sizes, accumulation, clipping, ZeRO stage, precision) must agree with it, and "
        "'optimizer'/'scheduler' sections are refused. A mapping or JSON text is checked "
        "at construction; a file, and the accumulation steps (they need the world size), "
        "when the strategy is set up.",
        json_schema_extra={"accepted": "null, a mapping, JSON object text or a .json path"},
    )

    # -- engine / parallel ---------------------------------------------------------
    engine_type: str = Field(
        "vllm",
        description="Inference engine used for rollouts: vllm, sglang, hf, or a name "
        "registered under the 'lightrft.engines' entry points (lightrft-testing: fake).",
        json_schema_extra={"accepted": "'vllm', 'sglang', 'hf' or a registered engine name"},
    )
    engine_tp_size: Int = Field(1, gt=0, description="Tensor-parallel size of the engine.")
    enable_engine_sleep: bool = Field(
        False, description="Let the engine release memory (sleep) between rollouts."
    )
    local_rank: Int = Field(
        -1,
        ge=-1,
        description="Upstream's local rank; not read: a strategy takes the local rank from "
        "the launcher's environment (LOCAL_RANK under torchrun, SLURM_LOCALID under SLURM; "
        "0 without either).",
    )
    sp_size: Int = Field(1, gt=0, description="Sequence-parallel size.")

    # -- optimiser -----------------------------------------------------------------
    actor_learning_rate: Float = Field(1e-5, gt=0, description="Actor learning rate.")
    critic_learning_rate: Float = Field(1e-5, gt=0, description="Critic learning rate.")
    adam_betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95),
        description="Adam (beta1, beta2).",
        json_schema_extra={"accepted": "a pair of numbers, each >= 0 and < 1"},
    )
    l2: Float = Field(0.0, ge=0, description="Weight decay.")
    lr_warmup_ratio: Float = Field(
        0.03, ge=0, le=1, description="Fraction of steps spent warming up the learning rate."
    )

    # -- LoRA (argparse names and defaults of upstream's gsm8k_geo3k/train_colocate.py)
    lora_rank: Int = Field(
        0, ge=0, description="LoRA rank of the actor's adapter (0: train every weight)."
    )
    lora_alpha: Int = Field(
        16, gt=0, description="LoRA alpha: the adapter is scaled by alpha/rank."
    )
    lora_dropout: Float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA adapter's input.")
    target_modules: list[str] = Field(
        ["all-linear"],
        description="Modules that get a LoRA adapter: names (peft's matching) or all-linear.",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description=(
            "How a LoRA actor's weights reach the rollout engine: merged (base + scaled "
            "adapter under the base model's names; every engine) or adapter (the adapter "
            "alone, to an engine that serves adapters: vLLM, SGLang, the fake)."
        ),
    )

    # -- control -------------------------------------------------------------------
    critic_pretrain: FlagOrPath = Field(
        False, description="Critic initialisation: a flag or, as upstream, a model path."
    )
    remote_rm_url: str | None = Field(None, description="URL of a remote reward model.")
    pretrain_data: str | None = Field(None, description="Pretraining data mixed into training.")
    fused_linear_logprob: bool = Field(False, description="Fused linear + log-prob kernel.")

    # -- reward / advantage --------------------------------------------------------
    reward_running_norm: bool = Field(False, description="Normalise rewards by running stats.")
    reward_running_norm_minus_mean: bool = Field(
        False, description="Also subtract the running mean when normalising rewards."
    )
    advantages_norm: bool = Field(False, description="Whiten advantages.")
    advantage_clip: Float = Field(0.0, ge=0, description="Clip advantages to +-value (0: off).")
    reward_clip: Float = Field(0.0, ge=0, description="Clip rewards to +-value (0: off).")

    # -- rollout -------------------------------------------------------------------
    micro_rollout_batch_size: Int = Field(2, gt=0, description="Prompts per rollout micro-batch.")
    n_samples_per_prompt: Int = Field(8, gt=0, description="Samples generated per prompt.")
    overlong_buffer: bool = Field(False, description="Penalise responses near the length limit.")
    overlong_buffer_len: Int = Field(1024, ge=0, description="Tokens of the overlong buffer.")
    overlong_buffer_penalty_factor: Float = Field(
        1.0, ge=0, description="Penalty factor of the overlong buffer."
    )
    dynamic_sampling: bool = Field(False, description="Drop groups with identical rewards.")
    advantage_estimator: str = Field(
        "group_norm", min_length=1, description="Advantage estimator name (e.g. group_norm, gae)."
    )
    use_kl_loss: bool = Field(False, description="Add a KL term to the loss.")
    kl_estimator: str = Field("k3", min_length=1, description="KL estimator name (k1, k2, k3).")

    # -- FSDP extra / monitoring ---------------------------------------------------
    mixed_mm_data: bool = Field(False, description="Batches mix text-only and multimodal data.")
    use_mp_opt: bool = Field(False, description="Mixed-precision optimizer (FSDP).")
    plot_every: Int = Field(
        -1,
        ge=-1,
        description="Plot metrics every N steps (-1: never).",
        json_schema_extra={"accepted": "-1 (never) or an integer >= 1"},
    )
    use_tensorboard: FlagOrPath = Field(
        False, description="Log to TensorBoard: a flag or, as upstream, a log directory."
    )

    # -- new: backend and device ---------------------------------------------------
    backend: str | None = Field(
        None,
        description="(new) Training backend: deepspeed, fsdp2 (alias fsdp), or a name registered "
        "under the lightrft.strategies entry points (fake, from lightrft-testing); None chooses "
        "by `fsdp` as upstream did.",
        json_schema_extra={"accepted": "null or a known backend name"},
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="(new) Device: auto picks cuda when available, else cpu."
    )
    # -- micro-batches (issue 36) -----------------------------------------------------
    packing_samples: bool = Field(
        False,
        description="Pack several samples into one row, each with its own positions "
        "(upstream's --packing_samples): read by training code, and by "
        "strategy.plan_micro_batches, which packs under max_tokens_per_gpu.",
    )
    max_tokens_per_gpu: Int | None = Field(
        None,
        gt=0,
        description="(new) Token budget of one micro-batch on one rank. "
        "strategy.plan_micro_batches splits each step's samples into as few packed "
        "micro-batches under it as it can, the same number on every data-parallel rank, "
        "and the step's gradient accumulation follows them; a sample longer than the "
        "budget runs alone in its own micro-batch, with a warning. None keeps fixed "
        "micro-batches of micro_train_batch_size samples. Needs packing_samples.",
        json_schema_extra={"accepted": "null or an integer >= 1"},
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="(new) How a planned step's loss is normalised (verl's names): "
        "'token-mean' is the mean over every loss token of the step on every rank; "
        "'seq-mean-token-mean' is each sample's mean over its tokens, then the mean over "
        "the step's samples on every rank. Either way a step's gradient does not depend "
        "on how its samples were split into micro-batches.",
    )
    dist_timeout_s: Float = Field(
        1800.0,
        gt=0,
        description="(new) Seconds a collective may wait for the other ranks: the process "
        "group, its sub-groups (sequence parallel, engine tensor parallel), weight sync and "
        "generation. When it fires, the error names the operation and the ranks that did not "
        "arrive. setup_distributed(timeout=...), upstream's parameter, wins over it.",
    )

    # -- new: precision, FSDP2 layout, schedule ----------------------------------------
    precision: Literal["bf16", "fp16", "fp32"] | None = Field(
        None,
        description="(new) Mixed-precision dtype of parameters in compute; None: bf16 when "
        "`bf16` is true, else fp32. Setting it also sets `bf16` to match.",
        json_schema_extra={"accepted": "null or one of 'bf16', 'fp16', 'fp32'"},
    )
    fsdp_shard_size: Int | None = Field(
        None,
        gt=0,
        description="(new) FSDP2 HSDP: ranks per shard group, replicated across groups "
        "(None: shard over all ranks). Must divide the world size.",
        json_schema_extra={"accepted": "null or an integer > 0"},
    )
    fsdp_wrap_modules: list[str] | None = Field(
        None,
        description="(new) Module class names FSDP2 shards one by one (None: the model's "
        "`_no_split_modules`, else every element of its nn.ModuleLists).",
        json_schema_extra={"accepted": "null or a list of class names"},
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="(new) FSDP2: free gathered parameters after forward (ZeRO-3 like)."
    )
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant_with_warmup"] = Field(
        "cosine_with_min_lr",
        description="(new) Learning-rate schedule after warmup (upstream: cosine to a "
        "minimum of min_lr_ratio x the learning rate).",
    )
    min_lr_ratio: Float = Field(
        0.1, ge=0, le=1, description="(new) cosine_with_min_lr: final lr / peak lr."
    )

    # -- new: engine options upstream read from raw args -----------------------------
    engine_mem_util: Float = Field(
        0.5, gt=0, le=1, description="(new) Fraction of accelerator memory the engine may use."
    )
    engine_max_model_len: Int | None = Field(
        None,
        gt=0,
        description="(new) Engine context length in tokens (None: the model's own).",
        json_schema_extra={"accepted": "null or an integer > 0"},
    )
    engine_sleep_level: Int | None = Field(
        None,
        ge=1,
        le=2,
        description="(new) Sleep level: 1 offloads weights, 2 discards them (needs a resync). "
        "Requires enable_engine_sleep; None means 1 when sleep is enabled.",
        json_schema_extra={"accepted": "null, 1 or 2"},
    )
    engine_placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="(new) Where the rollout engines run: colocated (every rank trains and "
        "serves, in turns; upstream's layout) or separate (the last engine_ranks ranks of the "
        "job serve, the others train; verl's rollout.nnodes x rollout.n_gpus_per_node in its "
        "one-step-off-policy recipe, OpenRLHF's vllm.num_engines x vllm.tensor_parallel_size).",
    )
    engine_ranks: Int | None = Field(
        None,
        gt=0,
        description="(new) engine_placement separate: how many ranks of the job (the last "
        "ones) serve engines (None: 1); engine_tp_size must divide it.",
        json_schema_extra={"accepted": "null or an integer > 0"},
    )
    max_staleness: Int = Field(
        0,
        ge=0,
        description="(new) engine_placement separate: optimizer steps the weights that "
        "generated a rollout may lag the trainer's when it is trained on; 0: the newest "
        "weights always, 1: one-step-off-policy (AReaL's max_head_offpolicyness, NeMo RL's "
        "max_trajectory_age_steps, OpenRLHF's train.async_queue_size).",
    )
    verify_engine_sync: bool = Field(
        False,
        description="(new) After each update_engine_weights, check that the engine's logprobs "
        "of a short greedy probe equal the trainer's (one small generation and forward).",
    )

    # -- new: checkpoints ----------------------------------------------------------
    max_ckpt_num: Int = Field(3, gt=0, description="(new) Checkpoints kept by rotation.")
    max_ckpt_mem: Float = Field(
        1e8,
        gt=0,
        description="(new) Total size of kept checkpoints, in GiB (2**30 bytes); the newest "
        "checkpoint is never deleted.",
    )

    # -- everything from_args did not recognise ---------------------------------------
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Names from_args did not recognise, with their values."
    )

    _summary_logged: bool = PrivateAttr(default=False)

    #: The environment-variable prefix read by :meth:`from_env` and :meth:`load`.
    ENV_PREFIX: ClassVar[str] = "LIGHTRFT_"

    # -- validation ------------------------------------------------------------------
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise from_validation_error(exc, type(self), data) from None

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic stores the new value before the cross-field (model "after") checks
        # run; put the old state back when they refuse it.
        before, fields_set = dict(self.__dict__), set(self.__pydantic_fields_set__)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            self.__dict__.clear()
            self.__dict__.update(before)
            self.__pydantic_fields_set__.clear()
            self.__pydantic_fields_set__.update(fields_set)
            raise from_validation_error(exc, type(self), {name: value}) from None

    @field_validator("plot_every")
    @classmethod
    def _plot_every_not_zero(cls, value: int) -> int:
        if value == 0:
            raise PydanticCustomError("plot_every_zero", "0 would plot at no step")
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = canonical_backend_name(value)
        if name not in BUILTIN_BACKENDS and name not in known_backend_names():
            raise PydanticCustomError(
                "unknown_backend",
                "unknown backend; choose one of {choices} (other backends register under "
                "the 'lightrft.strategies' entry-point group: 'fake' comes with "
                "lightrft-testing)",
                {"choices": ", ".join(known_backend_names())},
            )
        return name

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_target_module(cls, value: Any) -> Any:
        """Upstream's argparse default is the string ``"all-linear"`` (``nargs="*"``
        gives a list when the flag is used): a string is a list of one name."""
        return [value] if isinstance(value, str) else value

    @field_validator("engine_type")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        name = value.strip().lower()
        if name in BUILTIN_ENGINES:  # no entry-point scan (it costs milliseconds a call)
            return name
        known = known_engine_names()
        if name not in known:
            guess = closest(name, known)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise PydanticCustomError(
                "unknown_engine",
                "unknown engine{hint}; choose one of {choices} (other engines register under "
                "the 'lightrft.engines' entry-point group: 'fake' comes with lightrft-testing)",
                {"hint": hint, "choices": ", ".join(repr(n) for n in known)},
            )
        return name

    @model_validator(mode="before")
    @classmethod
    def _backend_implies_fsdp(cls, data: Any) -> Any:
        # Upstream code reads `config.fsdp`; keep it true when FSDP2 is chosen by name.
        # An argparse namespace always carries fsdp=False when the flag was not given,
        # so an explicit backend name wins over a false `fsdp`.
        backend = data.get("backend") if isinstance(data, dict) else None
        if isinstance(backend, str) and canonical_backend_name(backend) == "fsdp2":
            data = {**data, "fsdp": True}
        # Likewise `bf16` follows an explicit precision.
        precision = data.get("precision") if isinstance(data, dict) else None
        if precision in ("bf16", "fp16", "fp32"):
            data = {**data, "bf16": precision == "bf16"}
        return data

    @model_validator(mode="after")
    def _check_cross_field(self) -> StrategyConfig:
        problems: list[ConfigProblem] = []
        micro, total = self.micro_train_batch_size, self.train_batch_size
        if total % micro:
            lower, upper = total - total % micro, total - total % micro + micro
            nearest = f"{lower} or {upper}" if lower else str(upper)
            problems.append(
                _joined(
                    "train_batch_size",
                    total,
                    f"is not a multiple of micro_train_batch_size={micro}",
                    f"set train_batch_size to {nearest}, or change micro_train_batch_size",
                )
            )
        if self.backend == "deepspeed" and self.fsdp:
            problems.append(
                _joined(
                    "backend",
                    "deepspeed",
                    "contradicts fsdp=True",
                    "drop one of them (backend takes a name, fsdp is the upstream switch)",
                )
            )
        if self.precision is not None and self.bf16 != (self.precision == "bf16"):
            problems.append(  # reachable by assignment only
                _joined(
                    "precision", self.precision, f"contradicts bf16={self.bf16}", "set one of them"
                )
            )
        if self.backend == "fsdp2" and not self.fsdp:  # reachable by assignment only
            problems.append(
                _joined("backend", "fsdp2", "contradicts fsdp=False", "set fsdp=True as well")
            )
        if self.engine_sleep_level is not None and not self.enable_engine_sleep:
            problems.append(
                _joined(
                    "engine_sleep_level",
                    self.engine_sleep_level,
                    "needs enable_engine_sleep=True",
                    "enable sleep or leave engine_sleep_level unset",
                )
            )
        if self.lora_sync == "adapter" and self.lora_rank == 0:
            problems.append(
                _joined(
                    "lora_sync",
                    "adapter",
                    "needs a LoRA actor, and lora_rank=0",
                    "set lora_rank >= 1, or leave lora_sync at merged",
                )
            )
        if self.max_tokens_per_gpu is not None and not self.packing_samples:
            problems.append(
                _joined(
                    "max_tokens_per_gpu",
                    self.max_tokens_per_gpu,
                    "needs packing_samples=True (a token budget packs samples into rows)",
                    "set packing_samples=True, or leave max_tokens_per_gpu unset for fixed "
                    "micro-batches of micro_train_batch_size samples",
                )
            )
        problems.extend(placement_problems(self))
        if self.resolved_backend == "deepspeed":
            problems.extend(self._deepspeed_problems())
        if problems:
            raise _cross_field(problems)
        return self

    def _deepspeed_problems(self) -> list[ConfigProblem]:
        # deepspeed_rules, with what is known without a world size; ds_config applies the
        # same rules at setup (then with the world size, and a file overlay read)
        problems = [adam_offload_problem(self.adam_offload, self.zero_stage)]
        overlay = self.deepspeed_config
        if isinstance(overlay, dict):  # not None, nor a file read when the strategy is set up
            derived = derived_keys(self)
            # micro x accumulation x every rank = train_batch_size x sp_size at any world size
            derived["train_batch_size"] = (
                self.train_batch_size * self.sp_size,
                f"it follows train_batch_size={self.train_batch_size} x sp_size={self.sp_size} "
                "(DeepSpeed counts sequence-parallel ranks too); change those instead",
            )
            problems.extend(overlay_problems(overlay, derived))
        return [problem for problem in problems if problem is not None]

    # -- derived values ----------------------------------------------------------------
    @property
    def resolved_backend(self) -> str:
        """The backend to build: ``backend`` if set, else ``fsdp2``/``deepspeed`` by ``fsdp``."""
        if self.backend is not None:
            return self.backend
        return "fsdp2" if self.fsdp else "deepspeed"

    @property
    def resolved_precision(self) -> Literal["bf16", "fp16", "fp32"]:
        """The compute dtype in force: ``precision`` if set, else by ``bf16``."""
        if self.precision is not None:
            return self.precision
        return "bf16" if self.bf16 else "fp32"

    @property
    def sleep_level(self) -> int | None:
        """The engine sleep level in force: ``None`` when sleep is disabled."""
        if not self.enable_engine_sleep:
            return None
        return self.engine_sleep_level or 1

    def validate_world_size(self, world_size: int) -> None:
        """Check the settings that depend on the number of ranks.

        The strategy calls this with the launcher's world size before it joins the
        process group (the fake strategy with 1). Raises
        :class:`ConfigError` naming every size that does not fit ``world_size``.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(
                [ConfigProblem("world_size", world_size, "must be a positive integer")]
            )
        problems = engine_ranks_problems(self, world_size)
        if problems:
            raise ConfigError(problems)
        job, world_size = world_size, self.trainer_ranks(world_size)
        trainers = f" ({world_size} trainer ranks of {job})" if world_size != job else ""
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        sized = ["sp_size"] + (["engine_tp_size"] if world_size == job else [])
        if self.resolved_backend == "deepspeed":
            sized.append("zpg")
        if self.resolved_backend == "fsdp2" and self.fsdp_shard_size is not None:
            sized.append("fsdp_shard_size")
        problems = [
            ConfigProblem(
                name,
                getattr(self, name),
                f"does not divide the world size {world_size}{trainers}",
                accepted=f"a divisor of {world_size}: {', '.join(map(str, divisors))}",
            )
            for name in sized
            if world_size % getattr(self, name)
        ]
        if not problems:
            dp = world_size // self.sp_size
            per_step = self.micro_train_batch_size * dp
            if self.train_batch_size % per_step:
                lower = self.train_batch_size - self.train_batch_size % per_step
                problems.append(
                    ConfigProblem(
                        "train_batch_size",
                        self.train_batch_size,
                        f"is not a multiple of micro_train_batch_size x data-parallel size = "
                        f"{self.micro_train_batch_size} x {dp} = {per_step} "
                        f"(world size {world_size} / sp_size {self.sp_size})",
                        accepted=f"a multiple of {per_step}, e.g. {lower or per_step}"
                        + (f" or {lower + per_step}" if lower else ""),
                    )
                )
        if problems:
            raise ConfigError(problems)

    def trainer_ranks(self, world_size: int) -> int:
        """The ranks of a job of ``world_size`` that train: all of them, or with
        ``engine_placement: separate`` those before the last ``engine_ranks``."""
        if self.engine_placement == "separate":
            return world_size - (self.engine_ranks or 1)
        return world_size

    def gradient_accumulation_steps(self, world_size: int) -> int:
        """Micro-batches accumulated per optimizer step in a job of ``world_size`` ranks."""
        self.validate_world_size(world_size)
        dp = self.trainer_ranks(world_size) // self.sp_size
        return self.train_batch_size // (self.micro_train_batch_size * dp)

    # -- reading from other objects ------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, /, **overrides: Any) -> StrategyConfig:
        """Build a config from an argparse namespace, a mapping, any object with
        attributes, or another StrategyConfig; ``overrides`` win over ``args``.

        Known names are validated and converted (a list ``adam_betas`` becomes a tuple;
        ``None`` for a field that cannot be null means "not given"). Every other name
        lands in ``extra_args``; one that is a single edit away from a field logs a
        warning naming that field.
        """
        values = {**sources.as_mapping(args), **overrides}
        return cls._from_values(values, {})

    @classmethod
    def _from_values(cls, values: Mapping[str, Any], origin: Mapping[str, str]) -> StrategyConfig:
        fields = cls.model_fields
        known: dict[str, Any] = {}
        extra: dict[str, Any] = dict(values.get("extra_args") or {})
        for name, value in values.items():
            if name == "extra_args":
                continue
            if name not in fields:
                guess = one_edit_away(name, fields)
                if guess is not None:
                    logger.warning(
                        "unknown config name %r%s kept in extra_args; did you mean %r?",
                        name,
                        f" (from {origin[name]})" if name in origin else "",
                        guess,
                    )
                extra[name] = value
            elif value is None and not sources.is_nullable(fields[name]):
                logger.debug("config name %r is None; using its default", name)
            else:
                known[name] = value
        try:
            return cls(**known, extra_args=extra)
        except ConfigError as exc:
            raise exc.with_sources(origin) from None

    def get_extra_arg(self, name: str, default: Any = None) -> Any:
        """The value of an argument from_args did not recognise, or ``default``.

        A name that is a field returns the field's value, so callers need not know
        which names the config models.
        """
        if name in type(self).model_fields and name != "extra_args":
            return getattr(self, name)
        return self.extra_args.get(name, default)

    # -- files, environment, command line ------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike[str], /, **overrides: Any) -> StrategyConfig:
        """Load a YAML (``.yaml``/``.yml``, needs the ``yaml`` extra) or JSON file."""
        return cls.load(file=path, environ={}, **overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StrategyConfig:
        """Defaults overridden by ``LIGHTRFT_<FIELD>`` environment variables."""
        return cls.load(environ=os.environ if environ is None else environ)

    @classmethod
    def load(
        cls,
        *,
        file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        args: Any = None,
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> StrategyConfig:
        """Layered loading. Later layers win:

        the fields' defaults < ``defaults`` (a program's own, e.g. a recipe's) <
        ``file`` < environment (``LIGHTRFT_*``; ``os.environ`` when ``environ`` is
        None, pass ``{}`` to ignore it) < ``args`` (flags given on the command line, a
        mapping or namespace) < keyword ``overrides``.
        """
        layers = sources.collect_layers(
            cls, file=file, environ=os.environ if environ is None else environ, args=args
        )
        if defaults:
            layers.insert(0, (dict(defaults), dict.fromkeys(defaults, "the program's defaults")))
        layers.append((dict(overrides), dict.fromkeys(overrides, "keyword argument")))
        values, origin = sources.merge_layers(layers)
        return cls._from_values(values, origin)

    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser,
        *,
        suppress_defaults: bool = False,
        shown_defaults: Mapping[str, Any] | None = None,
    ) -> argparse.ArgumentParser:
        """Add one flag per field (``--zero_stage`` and ``--zero-stage``) to ``parser``.

        With ``suppress_defaults`` an absent flag is absent from the namespace, which
        lets :meth:`load` tell given flags from defaults. ``shown_defaults`` (field name
        -> value) is what ``--help`` shows as each flag's default, for a program whose
        file or environment changes them (``StrategyConfig.load(file=...)``'s values).
        """
        return sources.add_arguments(
            cls, parser, suppress_defaults=suppress_defaults, shown_defaults=shown_defaults
        )

    @classmethod
    def from_argv(
        cls,
        argv: Sequence[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        prog: str | None = None,
    ) -> StrategyConfig:
        """Parse command-line flags (plus ``--config FILE``) and load them over the file
        and the environment, as :meth:`load` does."""
        parser = argparse.ArgumentParser(prog=prog, description="LightRFT strategy configuration")
        parser.add_argument("--config", metavar="FILE", help="YAML or JSON config file")
        cls.add_arguments(parser, suppress_defaults=True)
        namespace = vars(parser.parse_args(argv))
        file = namespace.pop("config", None)
        return cls.load(file=file, environ=environ, args=namespace)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of the configuration (descriptions, types, bounds)."""
        return cls.model_json_schema()

    # -- summary ---------------------------------------------------------------------------
    def summary(self) -> str:
        """Readable text naming the values that differ from the defaults."""
        return summary.render(self)

    def log_summary(self, *, rank: int | None = None, log: logging.Logger | None = None) -> bool:
        """Log :meth:`summary` at INFO once per config, on rank 0 only.

        ``rank`` defaults to the ``RANK`` environment variable (0 when unset).
        Returns whether it logged.
        """
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        if rank != 0 or self._summary_logged:
            return False
        (log or logger).info("%s", self.summary())
        self._summary_logged = True
        return True
