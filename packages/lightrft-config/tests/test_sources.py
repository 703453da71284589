"""Files, environment, command-line flags, and their precedence."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from lightrft.config import ConfigError, StrategyConfig


def test_yaml_and_json_files_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("seed: 3\nadam_betas: [0.8, 0.9]\nzero_stage: 1\nteam: rl\n")
    (tmp_path / "c.json").write_text(
        json.dumps({"seed": 3, "adam_betas": [0.8, 0.9], "zero_stage": 1, "team": "rl"})
    )
    from_yaml = StrategyConfig.from_file(tmp_path / "c.yaml")
    from_json = StrategyConfig.from_file(tmp_path / "c.json")
    assert from_yaml == from_json
    assert (from_yaml.seed, from_yaml.adam_betas, from_yaml.zero_stage) == (3, (0.8, 0.9), 1)
    assert from_yaml.extra_args == {"team": "rl"}


def test_empty_yaml_file_is_all_defaults(tmp_path: Path) -> None:
    (tmp_path / "empty.yml").write_text("")
    assert StrategyConfig.from_file(tmp_path / "empty.yml") == StrategyConfig()


def test_file_ignores_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTRFT_SEED", "99")
    (tmp_path / "c.json").write_text("{}")
    assert StrategyConfig.from_file(tmp_path / "c.json").seed == 42


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("SEED", "7", 7),
        ("BF16", "false", False),
        ("BF16", "0", False),
        ("FSDP", "yes", True),
        ("ADAM_BETAS", "0.5, 0.6", (0.5, 0.6)),
        ("ADAM_BETAS", "[0.5, 0.6]", (0.5, 0.6)),
        ("GRAD_ACCUM_DTYPE", "bf16", "bf16"),
        ("GRAD_ACCUM_DTYPE", "none", None),
        ("ENGINE_MAX_MODEL_LEN", "4096", 4096),
        ("ACTOR_LEARNING_RATE", "2e-6", 2e-6),
        ("USE_TENSORBOARD", "/tmp/tb", "/tmp/tb"),
        ("USE_TENSORBOARD", "on", True),
        ("EXTRA_ARGS", '{"temperature": 0.7}', {"temperature": 0.7}),
        ("FSDP_WRAP_MODULES", "Block, Decoder", ["Block", "Decoder"]),
        ("FSDP_WRAP_MODULES", '["Block"]', ["Block"]),
    ],
)
def test_environment_values_are_parsed_per_field(name: str, raw: str, expected: object) -> None:
    config = StrategyConfig.from_env({f"LIGHTRFT_{name}": raw})
    assert getattr(config, name.lower()) == expected


def test_environment_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTRFT_ZERO_STAGE", "3")
    monkeypatch.setenv("LIGHTRFT_ROLLOUT_TEMPERATURE", "0.7")
    monkeypatch.setenv("NOT_LIGHTRFT_SEED", "1")
    config = StrategyConfig.from_env()
    assert config.zero_stage == 3
    assert config.seed == 42
    assert config.get_extra_arg("rollout_temperature") == "0.7"


def test_precedence_defaults_file_env_cli_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\nzero_stage: 1\nl2: 0.1\nsp_size: 2\nteam: file\n")
    environ = {"LIGHTRFT_ZERO_STAGE": "2", "LIGHTRFT_L2": "0.2", "LIGHTRFT_SP_SIZE": "4"}
    config = StrategyConfig.load(
        file=path, environ=environ, args={"l2": 0.3, "sp_size": 8}, sp_size=16
    )
    assert config.seed == 1  # file over default
    assert config.zero_stage == 2  # environment over file
    assert config.l2 == 0.3  # command line over environment
    assert config.sp_size == 16  # keyword override over command line
    assert config.train_batch_size == 128  # untouched default
    assert config.extra_args == {"team": "file"}


def test_a_programs_defaults_sit_below_the_file(tmp_path: Path) -> None:
    """``defaults`` (a program's own, as the demo's recipe): over the fields' defaults,
    under the file, the environment and the flags; a bad one is named by its source."""
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\n")
    mine = {"seed": 7, "train_batch_size": 32, "micro_train_batch_size": 8, "l2": 0.5}
    config = StrategyConfig.load(
        file=path, environ={"LIGHTRFT_L2": "0.2"}, args={"micro_train_batch_size": 4},
        defaults=mine,
    )  # fmt: skip
    assert config.seed == 1  # the file over the program's defaults
    assert config.l2 == 0.2  # the environment over them
    assert config.micro_train_batch_size == 4  # a flag over them
    assert config.train_batch_size == 32  # the program's default over the field's (128)
    assert StrategyConfig.load(environ={}, defaults={}).train_batch_size == 128
    with pytest.raises(ConfigError, match=r"zero_stage.*the program's defaults"):
        StrategyConfig.load(environ={}, defaults={"zero_stage": 7})


def test_from_argv_layers_flags_over_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"seed": 1, "zero_stage": 1, "bf16": false}')
    config = StrategyConfig.from_argv(
        ["--config", str(path), "--zero-stage", "3", "--adam_betas", "0.8", "0.9"],
        environ={"LIGHTRFT_SEED": "5", "LIGHTRFT_ZERO_STAGE": "0"},
    )
    assert (config.seed, config.zero_stage, config.bf16) == (5, 3, False)
    assert config.adam_betas == (0.8, 0.9)


def test_from_argv_bad_type_exits_with_argparse_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        StrategyConfig.from_argv(["--zero_stage", "two"], environ={})
    assert info.value.code == 2
    assert "argument --zero_stage/--zero-stage: invalid int value: 'two'" in capsys.readouterr().err


def test_add_arguments_defaults_equal_field_defaults() -> None:
    parser = StrategyConfig.add_arguments(argparse.ArgumentParser())
    namespace = parser.parse_args([])
    assert StrategyConfig.from_args(namespace) == StrategyConfig()
    assert namespace.adam_betas == (0.9, 0.95)


def test_add_arguments_gives_typed_values_to_code_that_reads_the_namespace() -> None:
    parser = StrategyConfig.add_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(
        [
            "--zero_stage", "3", "--no-bf16", "--fsdp", "--adam-betas", "0.8", "0.99",
            "--use_tensorboard", "--critic_pretrain", "/m/critic", "--grad_accum_dtype", "fp32",
            "--engine_max_model_len", "none", "--actor_learning_rate", "3e-6",
            "--fsdp_wrap_modules", "Block", "Decoder",
        ]
    )  # fmt: skip
    assert ns.zero_stage == 3
    assert ns.bf16 is False
    assert ns.fsdp is True
    assert ns.adam_betas == [0.8, 0.99]
    assert ns.use_tensorboard is True
    assert ns.critic_pretrain == "/m/critic"
    assert ns.grad_accum_dtype == "fp32"
    assert ns.engine_max_model_len is None
    assert ns.actor_learning_rate == 3e-6
    assert ns.fsdp_wrap_modules == ["Block", "Decoder"]
    config = StrategyConfig.from_args(ns)
    assert config.resolved_backend == "fsdp2"
    assert config.adam_betas == (0.8, 0.99)


def test_add_arguments_covers_every_field_and_keeps_existing_flags() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1234, help="the trainer's own seed flag")
    StrategyConfig.add_arguments(parser)
    help_text = parser.format_help()
    for name in StrategyConfig.model_fields:
        if name != "extra_args":
            assert f"--{name}" in help_text
    assert parser.parse_args([]).seed == 1234


def test_suppressed_defaults_leave_absent_flags_out() -> None:
    parser = StrategyConfig.add_arguments(argparse.ArgumentParser(), suppress_defaults=True)
    assert vars(parser.parse_args(["--seed", "3"])) == {"seed": 3}


def test_help_shows_the_defaults_a_file_sets(tmp_path: Path) -> None:
    """A program whose YAML file changes defaults shows those in --help, not the
    field's own (the file's values are what a run without the flag uses)."""
    file = tmp_path / "job.json"
    file.write_text(json.dumps({"train_batch_size": 256, "engine_type": "hf"}))
    effective = StrategyConfig.load(file=file, environ={})
    parser = StrategyConfig.add_arguments(
        argparse.ArgumentParser(), suppress_defaults=True, shown_defaults=effective.model_dump()
    )
    help_text = " ".join(parser.format_help().split())
    assert "(default: 256)" in help_text and "(default: 128)" not in help_text
    assert "(default: 'hf')" in help_text and "(default: 'vllm')" not in help_text


def test_deepspeed_config_from_mapping_json_text_or_path(tmp_path: Path) -> None:
    overlay = {"zero_optimization": {"reduce_bucket_size": 1000}}
    assert StrategyConfig(deepspeed_config=overlay).deepspeed_config == overlay
    text = json.dumps(overlay)
    # a flag and an environment variable carry JSON text, parsed into the mapping
    assert StrategyConfig.from_argv(["--deepspeed_config", text]).deepspeed_config == overlay
    env = {"LIGHTRFT_DEEPSPEED_CONFIG": text}
    assert StrategyConfig.load(environ=env).deepspeed_config == overlay
    # a path stays a path (the DeepSpeed backend reads it)
    path = tmp_path / "ds.json"
    assert StrategyConfig(deepspeed_config=path).deepspeed_config == str(path)
    assert StrategyConfig.from_argv(["--deepspeed-config", str(path)]).deepspeed_config == str(path)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("{not json", "not valid JSON"), (3, "valid dictionary"), ([1], "valid dictionary")],
)
def test_deepspeed_config_bad_values_name_the_field(value: object, expected: str) -> None:
    from lightrft.config import ConfigError

    with pytest.raises(ConfigError) as info:
        StrategyConfig(deepspeed_config=value)
    assert "deepspeed_config=" in str(info.value)
    assert expected in str(info.value)
    assert "a .json path" in str(info.value)
