"""Bad input: every error names the field, the bad value and what is accepted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from lightrft.config import ConfigError, StrategyConfig

# (keyword arguments, fragments the message must contain)
BAD_INPUTS: list[tuple[dict[str, Any], list[str]]] = [
    ({"seed": -1}, ["seed=-1", ">= 0"]),
    ({"seed": "abc"}, ["seed='abc'", "valid integer", "an integer"]),
    ({"seed": True}, ["seed=True", "boolean is not accepted", "an integer"]),
    ({"seed": 2**32}, ["seed=4294967296", "< 4294967296"]),
    ({"micro_train_batch_size": 0}, ["micro_train_batch_size=0", "greater than 0", "> 0"]),
    ({"micro_train_batch_size": 2.5}, ["micro_train_batch_size=2.5", "fractional part"]),
    ({"train_batch_size": -8}, ["train_batch_size=-8", "> 0"]),
    ({"zero_stage": 4}, ["zero_stage=4", "less than or equal to 3", ">= 0 and <= 3"]),
    ({"zero_stage": -1}, ["zero_stage=-1", ">= 0 and <= 3"]),
    (
        {"engine_type": "vlm"},
        ["engine_type='vlm'", "did you mean 'vllm'", "'vllm', 'sglang', 'hf'"],
    ),
    ({"engine_type": "trt"}, ["engine_type='trt'", "one of 'vllm', 'sglang', 'hf'"]),
    # an engine of another distribution: known once it is installed (not in this session)
    ({"engine_type": "fake"}, ["engine_type='fake'", "'lightrft.engines'", "lightrft-testing"]),
    ({"engine_tp_size": 0}, ["engine_tp_size=0", "> 0"]),
    ({"adam_betas": (0.9, 1.0)}, ["adam_betas=(0.9, 1.0)", "less than 1", "each >= 0 and < 1"]),
    ({"adam_betas": (0.9,)}, ["adam_betas=(0.9,)", "pair of numbers"]),
    ({"adam_betas": (-0.1, 0.9)}, ["adam_betas=(-0.1, 0.9)", "each >= 0 and < 1"]),
    ({"adam_betas": "high"}, ["adam_betas='high'", "pair of numbers"]),
    ({"actor_learning_rate": 0}, ["actor_learning_rate=0", "greater than 0", "> 0"]),
    ({"critic_learning_rate": -1e-5}, ["critic_learning_rate=-1e-05", "> 0"]),
    ({"actor_learning_rate": float("inf")}, ["actor_learning_rate=inf", "finite number"]),
    ({"max_norm": float("nan")}, ["max_norm=nan", "finite number"]),
    ({"l2": -0.1}, ["l2=-0.1", ">= 0"]),
    ({"lr_warmup_ratio": 1.5}, ["lr_warmup_ratio=1.5", ">= 0 and <= 1"]),
    ({"grad_accum_dtype": "fp8"}, ["grad_accum_dtype='fp8'", "'fp32', 'bf16', 'fp16'"]),
    ({"bf16": "maybe"}, ["bf16='maybe'", "valid boolean", "true or false"]),
    ({"local_rank": -2}, ["local_rank=-2", ">= -1"]),
    ({"sp_size": 0}, ["sp_size=0", "> 0"]),
    ({"zpg": 0}, ["zpg=0", "> 0"]),
    ({"plot_every": 0}, ["plot_every=0", "no step", "-1 (never) or an integer >= 1"]),
    ({"device": "tpu"}, ["device='tpu'", "'auto', 'cpu', 'cuda'"]),
    ({"device": "cpus"}, ["device='cpus'", "did you mean 'cpu'"]),
    (
        {"backend": "megatron"},
        ["backend='megatron'", "deepspeed, fsdp2", "lightrft.strategies", "lightrft-testing"],
    ),
    ({"engine_mem_util": 1.5}, ["engine_mem_util=1.5", "> 0 and <= 1"]),
    ({"engine_mem_util": 0}, ["engine_mem_util=0", "> 0 and <= 1"]),
    ({"engine_max_model_len": 0}, ["engine_max_model_len=0", "null or an integer > 0"]),
    (
        {"enable_engine_sleep": True, "engine_sleep_level": 3},
        ["engine_sleep_level=3", "null, 1 or 2"],
    ),
    ({"max_ckpt_num": 0}, ["max_ckpt_num=0", "> 0"]),
    ({"precision": "fp8"}, ["precision='fp8'", "'bf16', 'fp16', 'fp32'"]),
    ({"fsdp_shard_size": 0}, ["fsdp_shard_size=0", "null or an integer > 0"]),
    ({"fsdp_wrap_modules": "Block"}, ["fsdp_wrap_modules='Block'", "list of class names"]),
    ({"lr_scheduler": "cosin"}, ["lr_scheduler='cosin'", "did you mean 'cosine'"]),
    ({"min_lr_ratio": 2}, ["min_lr_ratio=2", ">= 0 and <= 1"]),
    ({"max_ckpt_mem": -1}, ["max_ckpt_mem=-1", "> 0"]),
    ({"advantage_estimator": ""}, ["advantage_estimator=''", "at least 1 character"]),
    ({"overlong_buffer_len": -5}, ["overlong_buffer_len=-5", ">= 0"]),
    ({"n_samples_per_prompt": 0}, ["n_samples_per_prompt=0", "> 0"]),
    ({"extra_args": [1, 2]}, ["extra_args=[1, 2]", "valid dictionary", "a mapping"]),
    ({"zero_stag": 3}, ["zero_stag=3", "unknown field", "did you mean 'zero_stage'"]),
    (
        {"train_batch_size": 10, "micro_train_batch_size": 3},
        ["train_batch_size=10", "micro_train_batch_size=3", "9 or 12"],
    ),
    (
        {"engine_sleep_level": 2},
        ["engine_sleep_level=2", "needs enable_engine_sleep=True"],
    ),
    ({"backend": "deepspeed", "fsdp": True}, ["backend='deepspeed'", "fsdp=True"]),
]


@pytest.mark.parametrize(
    ("kwargs", "fragments"), BAD_INPUTS, ids=[repr(k)[1:-1][:48] for k, _ in BAD_INPUTS]
)
def test_bad_value_is_named_with_what_is_accepted(
    kwargs: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_at_least_25_distinct_bad_inputs_are_covered() -> None:
    assert len({repr(k) for k, _ in BAD_INPUTS}) >= 25


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(seed=-1, zero_stage=9, engine_type="x")
    assert [p.field for p in info.value.problems] == ["seed", "zero_stage", "engine_type"]
    assert str(info.value).startswith("invalid StrategyConfig (3 problems):")


def test_problem_carries_structured_fields() -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig(zero_stage=9)
    (problem,) = info.value.problems
    assert (problem.field, problem.value, problem.accepted) == (
        "zero_stage",
        9,
        "an integer >= 0 and <= 3",
    )
    assert isinstance(info.value, ValueError)


# -- bad input from the other sources names the source -----------------------------------
@pytest.mark.parametrize(
    ("environ", "fragments"),
    [
        (
            {"LIGHTRFT_ZERO_STAGE": "five"},
            ["zero_stage='five'", "environment variable LIGHTRFT_ZERO_STAGE"],
        ),
        ({"LIGHTRFT_BF16": "perhaps"}, ["bf16='perhaps'", "LIGHTRFT_BF16", "true or false"]),
        (
            {"LIGHTRFT_ADAM_BETAS": "[0.9, 0.95"},
            ["adam_betas='[0.9, 0.95'", "not valid JSON", "LIGHTRFT_ADAM_BETAS"],
        ),
        ({"LIGHTRFT_ADAM_BETAS": "0.9"}, ["adam_betas=['0.9']", "LIGHTRFT_ADAM_BETAS"]),
        ({"LIGHTRFT_EXTRA_ARGS": "{oops"}, ["extra_args='{oops'", "not valid JSON"]),
        ({"LIGHTRFT_ENGINE_TYPE": "sglng"}, ["engine_type='sglng'", "did you mean 'sglang'"]),
    ],
)
def test_bad_environment_value_names_the_variable(
    environ: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        StrategyConfig.from_env(environ)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "fragments"),
    [
        ("bad.yaml", "seed: [1,\n", ["bad.yaml", "not valid YAML", "line"]),
        ("bad.json", '{"seed": 1,}', ["bad.json", "not valid JSON", "line 1 column"]),
        ("list.yaml", "- 1\n- 2\n", ["list.yaml", "mapping of field names", "found list"]),
        ("conf.toml", "seed = 1", ["conf.toml", "unsupported extension '.toml'"]),
        ("range.yaml", "zero_stage: 8\n", ["zero_stage=8", "range.yaml", "<= 3"]),
    ],
)
def test_bad_file_is_named(tmp_path: Path, name: str, text: str, fragments: list[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        StrategyConfig.from_file(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file '.*nowhere.yaml': no such file"):
        StrategyConfig.from_file(tmp_path / "nowhere.yaml")


def test_yaml_without_pyyaml_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match=r"pip install 'lightrft-config\[yaml\]'"):
        StrategyConfig.from_file(path)
    json_path = tmp_path / "c.json"
    json_path.write_text('{"seed": 1}')
    assert StrategyConfig.from_file(json_path).seed == 1


def test_bad_value_from_each_layer_names_its_layer(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"seed": -1}')
    cases: list[tuple[dict[str, Any], str]] = [
        ({"file": path}, "seed=-1 (from file "),
        (
            {"environ": {"LIGHTRFT_SEED": "-2"}},
            "seed='-2' (from environment variable LIGHTRFT_SEED)",
        ),
        ({"args": {"seed": -3}}, "seed=-3 (from command line --seed)"),
        ({"seed": -4}, "seed=-4 (from keyword argument)"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ConfigError) as info:
            StrategyConfig.load(**{"environ": {}, **kwargs})
        assert fragment in str(info.value), str(info.value)


def test_a_rule_joining_fields_keeps_its_field_value_source_and_fix() -> None:
    """Cross-field problems travel as ConfigProblem objects from the validator to the
    error (and to `lightrft config validate`), not as text parsed back."""
    with pytest.raises(ConfigError) as info:
        StrategyConfig.load(environ={"LIGHTRFT_TRAIN_BATCH_SIZE": "10"},
                            args={"micro_train_batch_size": 3})  # fmt: skip
    (problem,) = info.value.problems
    assert problem.field == "train_batch_size"
    assert problem.value == 10
    assert problem.source == "environment variable LIGHTRFT_TRAIN_BATCH_SIZE"
    assert problem.message == "is not a multiple of micro_train_batch_size=3"
    assert problem.fix == "set train_batch_size to 9 or 12, or change micro_train_batch_size"
    assert str(problem) == (
        "train_batch_size=10 (from environment variable LIGHTRFT_TRAIN_BATCH_SIZE) is not a "
        "multiple of micro_train_batch_size=3; set train_batch_size to 9 or 12, or change "
        "micro_train_batch_size"
    )
