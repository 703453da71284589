"""Field names, defaults and derived values of StrategyConfig."""

from __future__ import annotations

import pytest

from lightrft.config import ConfigError, StrategyConfig

# The upstream StrategyConfig (../shared/DESIGN.md appendix): names and defaults to keep.
UPSTREAM_DEFAULTS: dict[str, object] = {
    "seed": 42,
    "max_norm": 1.0,
    "micro_train_batch_size": 1,
    "train_batch_size": 128,
    "bf16": True,
    "zero_stage": 2,
    "fsdp": False,
    "fsdp_cpu_offload": False,
    "adam_offload": False,
    "zpg": 1,
    "grad_accum_dtype": None,
    "overlap_comm": False,
    "engine_type": "vllm",
    "engine_tp_size": 1,
    "enable_engine_sleep": False,
    "local_rank": -1,
    "sp_size": 1,
    "actor_learning_rate": 1e-5,
    "critic_learning_rate": 1e-5,
    "adam_betas": (0.9, 0.95),
    "l2": 0.0,
    "lr_warmup_ratio": 0.03,
    "critic_pretrain": False,
    "remote_rm_url": None,
    "pretrain_data": None,
    "fused_linear_logprob": False,
    "reward_running_norm": False,
    "reward_running_norm_minus_mean": False,
    "advantages_norm": False,
    "advantage_clip": 0.0,
    "reward_clip": 0.0,
    "micro_rollout_batch_size": 2,
    "n_samples_per_prompt": 8,
    "overlong_buffer": False,
    "overlong_buffer_len": 1024,
    "overlong_buffer_penalty_factor": 1.0,
    "dynamic_sampling": False,
    "advantage_estimator": "group_norm",
    "use_kl_loss": False,
    "kl_estimator": "k3",
    "mixed_mm_data": False,
    "use_mp_opt": False,
    "plot_every": -1,
    "use_tensorboard": False,
    "extra_args": {},
}

NEW_FIELDS: dict[str, object] = {
    "backend": None,
    "device": "auto",
    "dist_timeout_s": 1800.0,
    "engine_mem_util": 0.5,
    "engine_max_model_len": None,
    "verify_engine_sync": False,
    "engine_sleep_level": None,
    "max_ckpt_num": 3,
    "max_ckpt_mem": 1e8,
    "precision": None,
    "fsdp_shard_size": None,
    "fsdp_wrap_modules": None,
    "fsdp_reshard_after_forward": True,
    "lr_scheduler": "cosine_with_min_lr",
    "min_lr_ratio": 0.1,
    "deepspeed_config": None,
    "lora_sync": "merged",
    "max_tokens_per_gpu": None,
    "loss_agg_mode": "token-mean",
    "engine_placement": "colocated",
    "engine_ranks": None,
    "max_staleness": 0,
}

#: Argparse names of upstream's examples/gsm8k_geo3k/train_colocate.py (not in its
#: config.py), same defaults.
UPSTREAM_SCRIPT_FIELDS: dict[str, object] = {
    "lora_rank": 0,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["all-linear"],  # upstream's string "all-linear": a list of one
    "packing_samples": False,  # store_true, from lightrft/utils/cli_args.py
}


@pytest.mark.parametrize(("name", "default"), sorted(UPSTREAM_DEFAULTS.items()))
def test_upstream_field_keeps_name_and_default(name: str, default: object) -> None:
    value = getattr(StrategyConfig(), name)
    assert value == default
    assert type(value) is type(default)


def test_every_field_is_upstream_or_documented_new() -> None:
    assert set(StrategyConfig.model_fields) == (
        set(UPSTREAM_DEFAULTS) | set(NEW_FIELDS) | set(UPSTREAM_SCRIPT_FIELDS)
    )
    for name, default in {**NEW_FIELDS, **UPSTREAM_SCRIPT_FIELDS}.items():
        assert getattr(StrategyConfig(), name) == default


@pytest.mark.parametrize("name", sorted(StrategyConfig.model_fields))
def test_every_field_has_a_description(name: str) -> None:
    description = StrategyConfig.model_fields[name].description
    assert description
    assert len(description) > 10


def test_ckpt_mem_states_its_unit() -> None:
    assert "GiB" in (StrategyConfig.model_fields["max_ckpt_mem"].description or "")


def test_target_modules_take_upstreams_string_or_a_list() -> None:
    assert StrategyConfig(target_modules="all-linear").target_modules == ["all-linear"]
    assert StrategyConfig(target_modules=["q_proj", "v_proj"]).target_modules == [
        "q_proj",
        "v_proj",
    ]


def test_adapter_sync_needs_a_lora_rank() -> None:
    assert StrategyConfig(lora_rank=8, lora_sync="adapter").lora_sync == "adapter"
    with pytest.raises(
        ConfigError, match=r"lora_sync='adapter' needs a LoRA actor.*set lora_rank >= 1"
    ):
        StrategyConfig(lora_sync="adapter")
    with pytest.raises(
        ConfigError, match=r"lora_sync=.delta.: input should be .merged. or .adapter."
    ):
        StrategyConfig(lora_rank=8, lora_sync="delta")


def test_list_betas_become_a_tuple() -> None:
    assert StrategyConfig(adam_betas=[0.8, 0.99]).adam_betas == (0.8, 0.99)


@pytest.mark.parametrize(
    ("kwargs", "backend"),
    [
        ({}, "deepspeed"),
        ({"fsdp": True}, "fsdp2"),
        ({"backend": "fsdp"}, "fsdp2"),
        ({"backend": "FSDP2"}, "fsdp2"),
        ({"backend": "deepspeed"}, "deepspeed"),
    ],
)
def test_resolved_backend(kwargs: dict[str, object], backend: str) -> None:
    assert StrategyConfig(**kwargs).resolved_backend == backend


def test_fsdp_backend_sets_the_upstream_switch() -> None:
    config = StrategyConfig(backend="fsdp", fsdp=False)
    assert config.backend == "fsdp2"
    assert config.fsdp is True


def test_backend_and_fsdp_contradiction_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"backend='deepspeed' contradicts fsdp=True"):
        StrategyConfig(backend="deepspeed", fsdp=True)


def test_sleep_level_defaults_to_one_only_when_sleep_is_enabled() -> None:
    assert StrategyConfig().sleep_level is None
    assert StrategyConfig(enable_engine_sleep=True).sleep_level == 1
    assert StrategyConfig(enable_engine_sleep=True, engine_sleep_level=2).sleep_level == 2


def test_flag_or_path_fields_accept_both() -> None:
    config = StrategyConfig(critic_pretrain="/models/critic", use_tensorboard="true")
    assert config.critic_pretrain == "/models/critic"
    assert config.use_tensorboard is True


def test_assignment_is_validated_and_keeps_the_old_value() -> None:
    config = StrategyConfig()
    with pytest.raises(ConfigError, match=r"zero_stage=7: input should be less than or equal to 3"):
        config.zero_stage = 7
    assert config.zero_stage == 2
    config.zero_stage = 3
    assert config.zero_stage == 3


def test_construction_does_not_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="lightrft"):
        StrategyConfig(zero_stage=3, seed=1)
    assert caplog.records == []


@pytest.mark.parametrize(
    ("kwargs", "precision", "bf16"),
    [
        ({}, "bf16", True),
        ({"bf16": False}, "fp32", False),
        ({"precision": "fp16"}, "fp16", False),
        ({"precision": "fp32", "bf16": True}, "fp32", False),
        ({"precision": "bf16", "bf16": False}, "bf16", True),
    ],
)
def test_precision_and_the_bf16_switch_agree(
    kwargs: dict[str, object], precision: str, bf16: bool
) -> None:
    config = StrategyConfig(**kwargs)
    assert config.resolved_precision == precision
    assert config.bf16 is bf16


def test_a_token_budget_without_packing_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(max_tokens_per_gpu=4096)
    text = str(info.value)
    assert "max_tokens_per_gpu=4096" in text and "packing_samples=True" in text
    config = StrategyConfig(max_tokens_per_gpu=4096, packing_samples=True)
    assert config.max_tokens_per_gpu == 4096
    with pytest.raises(ConfigError, match="max_tokens_per_gpu"):
        StrategyConfig(max_tokens_per_gpu=0, packing_samples=True)
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        StrategyConfig(loss_agg_mode="seq-mean")
