"""`import lightrft.config` needs pydantic only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"torch", "numpy", "deepspeed", "vllm", "sglang"}:
                raise ImportError(f"{name} must not be imported by lightrft.config")
            return None
    sys.meta_path.insert(0, BlockTorch())
    import lightrft.config
    from lightrft.config import StrategyConfig
    config = StrategyConfig.from_args({"zero_stage": 3, "fsdp": True})
    config.validate_world_size(2)
    config.summary()
    StrategyConfig.json_schema()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "numpy"})
    assert not heavy, heavy
    print("ok")
    """
)


def test_config_works_with_torch_blocked() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_public_api() -> None:
    import lightrft.config as config

    assert config.__version__
    assert set(config.__all__) >= {"StrategyConfig", "ConfigError", "ConfigProblem"}
    for name in config.__all__:
        assert hasattr(config, name)
