"""The factory and the backend registry in one process: upstream inputs and names,
built-in and entry-point backends, errors naming the extra or the valid names, and an
import that loads no backend library. Also run by the deepspeed session (the outcome
depends on whether the extra is installed)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightrft.strategy as strategy_pkg
from lightrft.config import ConfigError
from lightrft.strategy import (
    StrategyConfig,
    UnknownBackendError,
    get_backend,
    get_strategy,
    register_backend,
)
from lightrft.strategy import registry as backend_registry
from lightrft.strategy.fsdp2 import FSDP2Strategy

from . import workers


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A copy of the run-time backend registry for the test; the original (without the
    test's registrations) is put back afterwards."""
    registered = dict(backend_registry._registered)
    monkeypatch.setattr(backend_registry, "_registered", registered)
    return registered


def test_compatibility_imports() -> None:
    from lightrft.strategy import get_fake_strategy  # noqa: F401
    from lightrft.strategy.config import StrategyConfig as Compat

    assert Compat is StrategyConfig
    assert set(strategy_pkg.__all__) >= {"get_strategy", "StrategyBase", "StrategyConfig"}


@pytest.mark.parametrize(
    "args",
    [
        argparse.Namespace(fsdp=True, seed=3, pretrain="x"),
        {"fsdp": True, "seed": 3},
        StrategyConfig(fsdp=True, seed=3),
        {"backend": "fsdp", "seed": 3},
    ],
    ids=["namespace", "dict", "config", "backend-name"],
)
def test_get_strategy_accepts_upstream_inputs(args: object) -> None:
    with get_strategy(args) as strategy:
        assert isinstance(strategy, FSDP2Strategy)
        assert strategy.config.seed == 3
        assert strategy.args is args
    with get_strategy(args=args) as by_keyword:  # upstream's get_strategy(args=...) spelling
        assert isinstance(by_keyword, FSDP2Strategy) and by_keyword.config.seed == 3
        assert by_keyword.args is args


def test_upstream_attribute_names_read_the_config() -> None:
    strategy = get_strategy(workers.config(zpg=1, overlap_comm=True, grad_accum_dtype="fp32",
                                           engine_type="hf"))  # fmt: skip
    assert strategy.bf16 is False and strategy.adam_offload is False
    assert (strategy.zpg, strategy.overlap_comm, strategy.grad_accum_dtype) == (1, True, "fp32")
    assert strategy.engine_type == "hf"
    strategy.setup_distributed(None, 8)  # upstream's num_gpu_per_node: accepted, not needed
    assert (strategy.world_size, strategy.accumulated_gradient) == (1, 4)
    strategy.close()


def test_default_backend_is_deepspeed_or_an_error_naming_its_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:  # the fsdp2 session
        with pytest.raises(ImportError, match=r"pip install 'lightrft-strategy\[deepspeed\]'"):
            get_strategy({})
    else:  # the deepspeed session
        with get_strategy({}) as strategy:
            assert type(strategy).__name__ == "DeepspeedStrategy"


def test_a_backend_missing_its_library_names_the_extra(own_registry: dict[str, object]) -> None:
    register_backend("needs_lib", "library_that_is_not_installed.mod:Strategy")
    with pytest.raises(
        ImportError,
        match=r"registered as 'library_that_is_not_installed.mod:Strategy', but module "
        r"'library_that_is_not_installed' cannot be imported; install the distribution",
    ):  # a run-time registration names no distribution: no made-up `pip install`
        get_backend("needs_lib")


def test_get_fake_strategy_comes_from_lightrft_testing_or_names_it() -> None:
    import subprocess
    import sys

    strategy = strategy_pkg.get_fake_strategy(seed=4)
    assert type(strategy).__name__ == "FakeStrategy" and strategy.config.seed == 4
    # lightrft-testing registers `fake` by entry point; lightrft.strategy imports no
    # lightrft.testing module of its own accord
    from importlib.metadata import entry_points

    (fake,) = entry_points(group="lightrft.strategies", name="fake")
    assert fake.dist is not None and fake.dist.name == "lightrft-testing"
    source = Path(strategy_pkg.__file__).parent
    assert not [p for p in source.rglob("*.py") if "lightrft.testing" in p.read_text()]
    hidden = (
        "import sys; sys.modules['lightrft.testing'] = None\n"
        "import lightrft.strategy as s\n"
        "try:\n    s.get_fake_strategy()\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", hidden], capture_output=True, text=True)
    assert "backend 'fake' needs lightrft-testing" in out.stdout, out.stdout + out.stderr


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(
        UnknownBackendError,
        match=r"unknown strategy backend 'megatron'; available: .*deepspeed, fake, fsdp2",
    ):
        get_backend("megatron")
    with pytest.raises(ConfigError, match="backend='megatron'"):
        get_strategy({"backend": "megatron"})


class CustomStrategy(FSDP2Strategy):
    backend_name = "custom"


def test_runtime_registration(own_registry: dict[str, object]) -> None:
    register_backend("custom", CustomStrategy)
    assert own_registry["custom"] is CustomStrategy  # the fixture's copy, dropped after
    assert get_backend("custom") is CustomStrategy
    assert "custom" in strategy_pkg.available_backends()


def test_entry_point_backend_is_found(tmp_path: Path) -> None:
    """A third-party distribution registering under lightrft.strategies, for real."""
    (tmp_path / "thirdparty_backend.py").write_text(
        "from lightrft.strategy.fsdp2 import FSDP2Strategy\n"
        "class ThirdParty(FSDP2Strategy):\n    backend_name = 'thirdparty'\n"
    )
    info = tmp_path / "thirdparty_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[lightrft.strategies]\nthirdparty = thirdparty_backend:ThirdParty\n"
    )
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from lightrft.strategy import get_strategy, available_backends
        s = get_strategy({{"backend": "thirdparty"}})
        print(type(s).__name__, "thirdparty" in available_backends())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ThirdParty", "True"]


def test_importing_the_package_imports_no_backend_library() -> None:
    code = (
        "import sys, lightrft.strategy; "
        "heavy = ('deepspeed', 'vllm', 'sglang', 'transformers'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
