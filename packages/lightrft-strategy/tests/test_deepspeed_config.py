"""The DeepSpeed configs, built without DeepSpeed: the mapping from StrategyConfig,
the user overlay, and the errors for overlays that contradict the strategy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightrft.config import ConfigError, StrategyConfig
from lightrft.strategy.deepspeed import ds_config


def train(world_size: int = 2, on_cuda: bool = False, **fields: Any) -> dict[str, Any]:
    config = StrategyConfig(backend="deepspeed", **fields)
    return ds_config.train_config(
        config,
        world_size=world_size,
        accumulation=config.gradient_accumulation_steps(world_size),
        on_cuda=on_cuda,
    )


def test_train_config_maps_every_strategy_field() -> None:
    ds = train(
        world_size=4,
        zero_stage=3,
        train_batch_size=64,
        micro_train_batch_size=2,
        max_norm=0.5,
        zpg=2,
        overlap_comm=True,
        grad_accum_dtype="fp32",
        precision="bf16",
    )
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 8  # 64 / (2 x 4)
    assert ds["train_batch_size"] == 64
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "zero_hpz_partition_size": 2,
    }
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["steps_per_print"] is None  # no progress lines from DeepSpeed


def test_sequence_parallel_ranks_count_in_deepspeeds_batch() -> None:
    # DeepSpeed sees every rank as data-parallel: micro x accumulation x world size
    ds = train(world_size=4, sp_size=2, train_batch_size=16, micro_train_batch_size=2)
    assert ds["gradient_accumulation_steps"] == 4  # 16 / (2 x 2 data-parallel ranks)
    assert ds["train_batch_size"] == 2 * 4 * 4


def test_clipping_off_and_stage0_fp32_where_the_strategy_clips() -> None:
    assert train(zero_stage=2, max_norm=0.0)["gradient_clipping"] == 0.0
    assert train(zero_stage=2, max_norm=-1.0)["gradient_clipping"] == 0.0
    # DeepSpeed at stage 0 in fp32 neither reports the norm nor skips non-finite
    # steps: the strategy clips there itself
    assert train(zero_stage=0, precision="fp32", max_norm=1.0)["gradient_clipping"] == 0.0
    assert train(zero_stage=0, precision="bf16", max_norm=1.0)["gradient_clipping"] == 1.0


def test_fp16_uses_dynamic_loss_scaling() -> None:
    ds = train(precision="fp16")
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0
    assert ds["bf16"] == {"enabled": False}


def test_adam_offload_on_cuda_and_its_limits() -> None:
    on_cuda = train(zero_stage=2, adam_offload=True, on_cuda=True)
    assert on_cuda["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # a CPU job keeps optimizer state in CPU memory already
    assert "offload_optimizer" not in train(zero_stage=2, adam_offload=True)["zero_optimization"]
    with pytest.raises(ConfigError, match=r"adam_offload=True: needs ZeRO stage 1, 2 or 3"):
        train(zero_stage=0, adam_offload=True)


def test_eval_config_is_stage3_only_when_training_is() -> None:
    for stage, expected in [(0, 0), (1, 0), (2, 0), (3, 3)]:
        config = StrategyConfig(backend="deepspeed", zero_stage=stage, micro_train_batch_size=4)
        ds = ds_config.eval_config(config, world_size=2, offload=True, on_cuda=False)
        assert ds["zero_optimization"]["stage"] == expected
        assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 1
        assert ("offload_param" in ds["zero_optimization"]) == (expected == 3)


def test_overlay_merges_deeply_into_both_configs(tmp_path: Path) -> None:
    overlay = {
        "zero_optimization": {"reduce_bucket_size": 1000, "stage": 2},
        "comms_logger": {"enabled": True},
        "train_batch_size": 128,  # agrees with the strategy: accepted
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(overlay))
    for given in (overlay, str(path), json.dumps(overlay)):
        ds = train(zero_stage=2, deepspeed_config=given)
        assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
        assert ds["zero_optimization"]["overlap_comm"] is False  # generated keys kept
        assert ds["comms_logger"] == {"enabled": True}
    config = StrategyConfig(backend="deepspeed", zero_stage=3, deepspeed_config=overlay | {
        "zero_optimization": {"reduce_bucket_size": 1000, "stage": 3}})  # fmt: skip
    evaluation = ds_config.eval_config(config, world_size=2, offload=False, on_cuda=False)
    assert evaluation["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}
    assert evaluation["train_batch_size"] == 2  # training batch keys do not apply


@pytest.mark.parametrize(
    ("overlay", "fields", "expected"),
    [
        (
            {"gradient_accumulation_steps": 4},
            {},
            r"gradient_accumulation_steps=4 contradicts the strategy's 64; it follows "
            r"train_batch_size=128, micro_train_batch_size=1 and 2 ranks",
        ),
        (
            {"train_micro_batch_size_per_gpu": 8},
            {},
            r"train_micro_batch_size_per_gpu=8 contradicts the strategy's 1; set "
            r"micro_train_batch_size instead",
        ),
        (
            {"gradient_clipping": 2.0},
            {"max_norm": 1.0},
            r"gradient_clipping=2.0 contradicts the strategy's 1.0; set max_norm instead",
        ),
        (
            {"zero_optimization": {"stage": 3}},
            {"zero_stage": 1},
            r"zero_optimization.stage=3 contradicts the strategy's 1; set zero_stage instead",
        ),
        (
            {"bf16": {"enabled": True}},
            {"precision": "fp32"},
            r"bf16.enabled=True contradicts the strategy's False; set precision instead",
        ),
        (
            {"optimizer": {"type": "Adam"}},
            {},
            r"sets a DeepSpeed 'optimizer' section; the strategy builds the optimizer",
        ),
    ],
)
def test_overlay_that_contradicts_the_strategy_is_refused(
    overlay: dict[str, Any], fields: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        train(deepspeed_config=overlay, **fields)
    assert str(info.value).startswith("invalid StrategyConfig")
    assert "deepspeed_config=" in str(info.value)


def test_stage0_fp32_overlay_may_repeat_max_norm() -> None:
    ds = train(zero_stage=0, precision="fp32", max_norm=1.0, deepspeed_config={
        "gradient_clipping": 1.0})  # fmt: skip
    assert ds["gradient_clipping"] == 0.0  # still the strategy's own clipping


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, r"cannot read the DeepSpeed JSON file"),
        ("{oops", r"is not valid JSON \(Expecting property name"),
        ("[1, 2]", r"holds a list, not an object"),
    ],
)
def test_bad_overlay_file_names_the_field_and_the_file(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=expected) as info:
        train(deepspeed_config=str(path))
    assert f"deepspeed_config='{path}'" in str(info.value)


def test_without_deepspeed_the_backend_names_the_extra() -> None:
    """Run where DeepSpeed is hidden (and, in the fsdp2 session, not installed): the
    config builder imports, the strategy does not, and the error names the extra."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import lightrft.strategy.deepspeed.ds_config\n"
        "from lightrft.strategy import get_strategy\n"
        "try:\n"
        "    get_strategy({'backend': 'deepspeed'})\n"
        "except ImportError as exc:\n"
        "    print('A', exc)\n"
        "try:\n"
        "    from lightrft.strategy.deepspeed import DeepspeedStrategy\n"
        "except ImportError as exc:\n"
        "    print('B', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "A backend 'deepspeed' needs lightrft-strategy[deepspeed]" in out
    assert "pip install 'lightrft-strategy[deepspeed]'" in out
    assert "B DeepspeedStrategy needs DeepSpeed; install it with" in out
