"""The upstream-style baseline: a plain dataclass and a getattr loop, no validation.

Mirrors how upstream LightRFT's StrategyConfig was written, so the benchmark can
show what typing and validation cost beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class UpstreamStrategyConfig:
    seed: int = 42
    max_norm: float = 1.0
    micro_train_batch_size: int = 1
    train_batch_size: int = 128
    bf16: bool = True
    zero_stage: int = 2
    fsdp: bool = False
    fsdp_cpu_offload: bool = False
    adam_offload: bool = False
    zpg: int = 1
    grad_accum_dtype: str | None = None
    overlap_comm: bool = False
    engine_type: str = "vllm"
    engine_tp_size: int = 1
    enable_engine_sleep: bool = False
    local_rank: int = -1
    sp_size: int = 1
    actor_learning_rate: float = 1e-5
    critic_learning_rate: float = 1e-5
    adam_betas: tuple[float, float] = (0.9, 0.95)
    l2: float = 0.0
    lr_warmup_ratio: float = 0.03
    critic_pretrain: bool = False
    remote_rm_url: str | None = None
    pretrain_data: str | None = None
    fused_linear_logprob: bool = False
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    advantages_norm: bool = False
    advantage_clip: float = 0.0
    reward_clip: float = 0.0
    micro_rollout_batch_size: int = 2
    n_samples_per_prompt: int = 8
    overlong_buffer: bool = False
    overlong_buffer_len: int = 1024
    overlong_buffer_penalty_factor: float = 1.0
    dynamic_sampling: bool = False
    advantage_estimator: str = "group_norm"
    use_kl_loss: bool = False
    kl_estimator: str = "k3"
    mixed_mm_data: bool = False
    use_mp_opt: bool = False
    plot_every: int = -1
    use_tensorboard: bool = False
    extra_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: Any) -> UpstreamStrategyConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra_args"}
        known = {name: getattr(args, name) for name in names if hasattr(args, name)}
        if "adam_betas" in known:
            known["adam_betas"] = tuple(known["adam_betas"])
        extra = {k: v for k, v in vars(args).items() if k not in names}
        return cls(**known, extra_args=extra)
