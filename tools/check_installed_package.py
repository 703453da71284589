"""Check one distribution installed alone into a clean environment.

Run by `nox -s packages` with the environment's own interpreter:

    python tools/check_installed_package.py lightrft-config lightrft.config
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

# What each distribution must work without (its promise to users).
MUST_NOT_NEED = {
    "lightrft-config": ["torch", "numpy", "deepspeed", "vllm", "sglang", "transformers"],
    "lightrft-strategy": ["deepspeed", "vllm", "sglang", "transformers"],
    "lightrft-engines": ["vllm", "sglang", "deepspeed"],
    "lightrft-testing": ["deepspeed", "vllm", "sglang"],
}


def main(distribution: str, module_name: str) -> int:
    sys.path[:] = [p for p in sys.path if p not in ("", str(Path.cwd()))]
    module = importlib.import_module(module_name)
    location = Path(module.__file__ or "").resolve()
    if "site-packages" not in location.parts:
        raise SystemExit(f"{module_name} imported from {location}, not from the installed wheel")
    installed = importlib.metadata.version(distribution)
    if getattr(module, "__version__", None) != installed:
        raise SystemExit(f"{module_name}.__version__ != installed version {installed}")
    namespace = importlib.import_module("lightrft")
    if getattr(namespace, "__file__", None) is not None:
        raise SystemExit("lightrft must be a PEP 420 namespace (no lightrft/__init__.py)")
    if not (location.parent / "py.typed").is_file():
        raise SystemExit(f"{distribution} does not ship py.typed")
    present = [m for m in MUST_NOT_NEED[distribution] if importlib.util.find_spec(m) is not None]
    if present:
        raise SystemExit(f"installing {distribution} alone pulled in {present}")
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(MUST_NOT_NEED[distribution]))
    if heavy:
        raise SystemExit(f"importing {module_name} imported {heavy}")
    if distribution == "lightrft-strategy":
        smoke_train_and_checkpoint()
    if distribution == "lightrft-testing":
        smoke_fake_strategy()
    print(f"{distribution} {installed}: installs alone and imports from {location.parent}")
    return 0


def smoke_train_and_checkpoint() -> None:
    """One FSDP2 step, a checkpoint saved and loaded: what needs every runtime dependency
    (torch.distributed, DCP, safetensors, the config's YAML reader)."""
    import tempfile

    import torch

    from lightrft.strategy import get_strategy

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "c.yaml"
        config.write_text("backend: fsdp2\ndevice: cpu\nbf16: false\ntrain_batch_size: 2\n"
                          "micro_train_batch_size: 2\n")  # fmt: skip
        from lightrft.config import StrategyConfig

        strategy = get_strategy(StrategyConfig.from_file(config))
        assert strategy.is_ready and strategy.accumulated_gradient == 1  # ready when built
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
            model, None, None, None, None, max_steps=2
        )
        strategy.backward(actor(torch.ones(2, 4)).sum(), actor, optim)
        assert strategy.optimizer_step(optim, actor, sched)
        strategy.save_ckpt(actor, Path(tmp) / "ckpt")
        strategy.load_ckpt(actor, Path(tmp) / "ckpt")
        strategy.save_model(actor, None, Path(tmp) / "export")
        assert (Path(tmp) / "export" / "model.safetensors").is_file()
        strategy.close()
    # without the deepspeed extra, the DeepSpeed backend says which extra to install
    try:
        get_strategy({"backend": "deepspeed"})
    except ImportError as exc:
        if "pip install 'lightrft-strategy[deepspeed]'" not in str(exc):
            raise SystemExit(f"the missing-extra error does not name the extra: {exc}") from exc
    else:
        raise SystemExit("backend='deepspeed' built a strategy without deepspeed installed")
    # without lightrft-testing there is no `fake` backend, and the errors say where it is
    from lightrft.config import ConfigError
    from lightrft.strategy import get_fake_strategy

    try:
        get_fake_strategy()
    except ImportError as exc:
        if "pip install lightrft-testing" not in str(exc):
            raise SystemExit(f"get_fake_strategy's error does not name its package: {exc}") from exc
    else:
        raise SystemExit("get_fake_strategy() worked without lightrft-testing installed")
    try:
        get_strategy({"backend": "fake"})
    except ConfigError as exc:
        if "lightrft-testing" not in str(exc):
            raise SystemExit(f"backend='fake' error does not name lightrft-testing: {exc}") from exc
    else:
        raise SystemExit("backend='fake' built a strategy without lightrft-testing installed")


def smoke_fake_strategy() -> None:
    """The spec's FakeStrategy example, as a downstream test would write it."""
    import tempfile

    import torch

    from lightrft.strategy import get_fake_strategy, get_strategy

    # `fake` reaches get_strategy through lightrft-testing's entry point
    assert type(get_strategy({"backend": "fake"})).__name__ == "FakeStrategy"
    with tempfile.TemporaryDirectory() as tmp:
        strategy = get_fake_strategy()
        strategy.setup_distributed()
        model = torch.nn.Linear(4, 1)
        optimizer = strategy.create_optimizer(model)
        strategy.backward(model(torch.ones(2, 4)).sum(), model, optimizer)
        strategy.save_ckpt(model, Path(tmp) / "checkpoints")
        assert (Path(tmp) / "checkpoints" / "latest").is_file()


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
