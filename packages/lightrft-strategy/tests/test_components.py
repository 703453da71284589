"""The strategy's shape: a training API holding components (``strategy.backend``,
``strategy.engine_link``), upstream's names kept apart, a checkpoint manager that is
handed what it saves. These tests fail when a hook or a helper drifts back onto the
strategy's namespace, so the split a newcomer reads stays true."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightrft.strategy.backend import Backend
from lightrft.strategy.base import StrategyBase
from lightrft.strategy.checkpoint import manager
from lightrft.strategy.engine_link import EngineLink
from lightrft.strategy.engine_link.generation import Generation
from lightrft.strategy.engine_link.sleep import Sleep
from lightrft.strategy.engine_link.weight_sync import WeightSync
from lightrft.strategy.upstream_names import UpstreamAttributes, UpstreamEngineCalls
from lightrft.strategy.world import World
from lightrft.testing import FakeStrategy

#: What StrategyBase itself defines: the training API a trainer calls, and the class
#: attributes naming its components. A new public member belongs here only if a trainer
#: calls it; a backend hook belongs on Backend, an engine call on EngineLink.
TRAINING_API = {
    # lifecycle and ranks
    "setup_distributed", "close", "is_ready", "set_seed", "world_size", "launch", "device",
    "get_rank",
    "is_rank_0", "barrier", "print", "all_reduce", "all_gather", "accumulated_gradient",
    # data, optimizers, models
    "setup_dataloader", "create_optimizer", "create_scheduler", "optimizer_of", "prepare",
    "prepare_model", "prepare_models_and_optimizers", "prepare_reward_model",
    "prepare_reward_models", "unwrap_model", "init_model_context", "step_state",
    # steps, offload, memory
    "backward", "optimizer_step", "plan_micro_batches", "maybe_offload_optimizer",
    "maybe_load_optimizer",
    "offload_model", "reload_model", "report_memory", "sync_and_clear_cache",
    # weights and checkpoints
    "full_state_dict", "full_gradients", "save_model", "load_model", "moving_average",
    "save_ckpt", "load_ckpt",
    # the engine calls of one shape, upstream's and ours (delegates to the engine link)
    "update_engine_weights", "verify_engine_weights", "maybe_sleep_inference_engine",
    "wakeup_inference_engine", "engine_generate_local",
    # rollouts submitted ahead (engine ranks of their own generate while the trainer trains)
    "submit_generation", "collect_generation", "rollout_lag",
    # which backend and engine link the class builds, and upstream's constructor order
    "backend_name", "backend_class", "engine_link_class", "upstream_parameters",
}  # fmt: skip
#: Upstream's engine calls whose shapes differ from ours, and its aliases: delegates to
#: the engine link, in upstream_names.
UPSTREAM_ENGINE_CALLS = {
    "setup_inference_engine", "gather_and_generate", "inference_engine", "engine_mp_group",
}  # fmt: skip
#: The engine link's parts, by attribute.
PARTS = {"generation": Generation, "sleep": Sleep, "weight_sync": WeightSync}
#: The strategy's engine calls of one shape (upstream's and ours): the part each calls.
STRATEGY_ENGINE_CALLS = {
    "update_engine_weights": "weight_sync.update_engine_weights",
    "verify_engine_weights": "weight_sync.verify_engine_weights",
    "engine_generate_local": "generation.generate_local",
    "maybe_sleep_inference_engine": "sleep.maybe_sleep",
    "wakeup_inference_engine": "sleep.wake_up",
}
#: Hooks that lived on the strategy before it held a backend.
FORMER_HOOKS = (
    "_prepare_train", "_prepare_train_model", "_prepare_eval", "_update_ema",
    "_load_full_weights", "_move_model", "_build_optimizer", "_model_for_optimizer",
    "_before_backward", "_after_setup", "_model_layout", "save_backend_state",
    "load_backend_state", "checkpoint_info", "optimizer_param_groups",
    "iter_full_parameters", "tracked_dataloaders", "restore_dataloader_states",
)  # fmt: skip


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_strategy_base_defines_only_the_training_api() -> None:
    assert _public(StrategyBase) == TRAINING_API


def test_upstream_names_are_delegates_apart_from_the_training_api() -> None:
    assert _public(UpstreamEngineCalls) == UPSTREAM_ENGINE_CALLS
    assert not _public(UpstreamAttributes) & TRAINING_API
    assert not UPSTREAM_ENGINE_CALLS & TRAINING_API
    # every delegate calls a member of the engine link of the same name, or these
    canonical = {
        "setup_inference_engine": ("build", "attach"),
        "gather_and_generate": ("generation.generate",),
        "engine_mp_group": ("engine_group",),
    }
    link = {n for n in dir(EngineLink) if not n.startswith("_")} | {"inference_engine"}
    parts = {f"{part}.{n}" for part, cls in PARTS.items() for n in dir(cls) if n[0] != "_"}
    for name in UPSTREAM_ENGINE_CALLS:
        assert set(canonical.get(name, (name,))) <= link | parts, name
    # the engine calls of one shape are the strategy's own, each a part's
    for name, call in STRATEGY_ENGINE_CALLS.items():
        assert name in vars(StrategyBase) and call in parts, name


@pytest.mark.parametrize("hook", FORMER_HOOKS)
def test_backend_hooks_are_not_strategy_members(hook: str) -> None:
    for cls in (StrategyBase, FakeStrategy):
        assert not hasattr(cls, hook), f"{cls.__name__}.{hook}"


def test_a_strategy_holds_its_backend_and_engine_link() -> None:
    with FakeStrategy(device="cpu") as strategy:
        assert isinstance(strategy.backend, Backend)
        assert strategy.backend.world is strategy.world
        assert isinstance(strategy.engine_link, EngineLink)
        assert strategy.engine_link.world is strategy.world
        assert strategy.engine_link.backend is strategy.backend
        # upstream's attribute is the link's
        assert strategy.inference_engine is None
        sentinel = object()
        strategy.inference_engine = sentinel
        assert strategy.engine_link.inference_engine is sentinel
        strategy.inference_engine = None


def test_a_strategy_class_without_a_backend_says_how_to_build_one() -> None:
    with pytest.raises(TypeError, match=r"names no backend_class.*get_strategy"):
        StrategyBase()


class _Counting(Backend):
    """A backend written against Backend alone: no sharding, state in one file, and a
    count of the hooks the strategy called."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.calls: list[str] = []

    def init_model_context(self, meta_init: bool = False) -> Any:
        import contextlib

        self.calls.append("init_model_context")
        return contextlib.nullcontext()

    def prepare_train(self, model: nn.Module, optimizer: Any, scheduler: Any) -> Any:
        self.calls.append("prepare_train")
        return model, optimizer, scheduler

    def prepare_train_model(self, model: nn.Module) -> nn.Module:
        self.calls.append("prepare_train_model")
        return model

    def prepare_eval(self, model: nn.Module) -> nn.Module:
        self.calls.append("prepare_eval")
        return model.eval()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.calls.append("full_state_dict")
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update_ema(self, model: nn.Module, model_ema: nn.Module, beta: float) -> None:
        self.calls.append("update_ema")

    def save_state(self, model: nn.Module, optimizer: Any, directory: Path) -> None:
        self.calls.append("save_state")
        torch.save(model.state_dict(), directory / "weights.pt")

    def load_state(self, model: nn.Module, optimizer: Any, directory: Path, strict: bool) -> None:
        self.calls.append("load_state")
        model.load_state_dict(torch.load(directory / "weights.pt", weights_only=True))


class _CountingStrategy(FakeStrategy):
    backend_name = "counting"
    backend_class = _Counting


def test_a_new_backend_needs_only_the_backend_interface(tmp_path: Path) -> None:
    with _CountingStrategy(
        device="cpu", precision="fp32", micro_train_batch_size=1, train_batch_size=1
    ) as strategy:
        backend = strategy.backend
        assert isinstance(backend, _Counting)
        with strategy.init_model_context():
            model = nn.Linear(3, 2)
        optim = strategy.create_optimizer(model, lr=0.1)
        model, optim, _ = strategy.prepare((model, optim, None))
        strategy.backward(model(torch.ones(4, 3)).sum(), model, optim)
        assert strategy.optimizer_step(optim, model)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        strategy.save_ckpt(model, tmp_path)
        with torch.no_grad():
            model.weight.zero_()
        strategy.load_ckpt(model, tmp_path)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
        assert backend.calls == ["init_model_context", "prepare_train", "save_state", "load_state"]


def test_the_checkpoint_manager_imports_nothing_of_the_strategy() -> None:
    tree = ast.parse(Path(inspect.getfile(manager)).read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    strategy_modules = {m for m in imported if m.startswith("lightrft.strategy")}
    assert strategy_modules <= {
        "lightrft.strategy.checkpoint.layout",
        "lightrft.strategy.checkpoint.rng",
        "lightrft.strategy.checkpoint.safe_io",
        "lightrft.strategy.checkpoint.subject",
        "lightrft.strategy.checkpoint.tokenizer",
        "lightrft.strategy.hf_export",
        "lightrft.strategy.lora",
        "lightrft.strategy.tensors",
        "lightrft.strategy.world",  # the type of what it is built with
    }, strategy_modules
    built = inspect.signature(manager.CheckpointManager).parameters
    assert list(built) == ["backend", "backend_name", "world"]
    assert "subject" in inspect.signature(manager.CheckpointManager.save).parameters


def test_the_checkpoint_manager_is_built_once_with_the_strategy() -> None:
    with FakeStrategy(device="cpu") as strategy:
        assert isinstance(strategy.checkpoints, manager.CheckpointManager)
        assert strategy.checkpoints.backend is strategy.backend
        assert strategy.checkpoints.world is strategy.world


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightrft" / "strategy"
#: The components a strategy holds: given a World (and the backend), never the strategy.
#: checkpoint/tools/ holds the offline tools (deepspeed_writer builds a strategy to
#: write DeepSpeed's files): not components, and not in checkpoint/ itself.
COMPONENT_MODULES = sorted(
    [PACKAGE / "world.py", PACKAGE / "backend.py", PACKAGE / "fsdp2" / "backend.py",
     PACKAGE / "deepspeed" / "backend.py", *(PACKAGE / "engine_link").glob("*.py"),
     *(PACKAGE / "checkpoint").glob("*.py")]
)  # fmt: skip
STRATEGY_MODULES = {"lightrft.strategy.base", "lightrft.strategy.strategy_base"}


def _reaches_the_strategy(path: Path) -> list[str]:
    """Where ``path`` reads an attribute named ``strategy``, imports the strategy's
    module, or imports StrategyBase / get_strategy."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "strategy":
            found.append(f"line {node.lineno}: .strategy")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {alias.name for alias in node.names}
            if node.module in STRATEGY_MODULES or (
                node.module.startswith("lightrft.strategy")
                and names & {"StrategyBase", "get_strategy", "base"}
            ):
                found.append(f"line {node.lineno}: from {node.module} import {sorted(names)}")
    return found


@pytest.mark.parametrize("path", COMPONENT_MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_component_never_reads_the_strategy_or_imports_its_module(path: Path) -> None:
    assert _reaches_the_strategy(path) == []


def test_the_check_finds_a_component_reaching_the_strategy(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from lightrft.strategy.base import StrategyBase\n"
        "from lightrft.strategy import get_strategy\n"
        "class B:\n    def f(self):\n        return self.strategy.config\n"
    )
    assert len(_reaches_the_strategy(bad)) == 3
    assert len(COMPONENT_MODULES) > 15


def test_a_backend_is_built_and_used_from_a_world_without_a_strategy() -> None:
    """FakeBackend on a World alone: a training step and a full state, no strategy."""
    from lightrft.config import StrategyConfig
    from lightrft.strategy.distributed import LaunchEnv
    from lightrft.testing.fake_strategy import FakeBackend

    config = StrategyConfig(backend="fake", train_batch_size=2, micro_train_batch_size=1)
    world = World(config)
    world.alone = True
    world.join(LaunchEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    assert world.accumulated_gradient == 2 and world.world_size == 1
    backend = FakeBackend(world)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optim = backend.build_optimizer([{"params": list(model.parameters())}], lr=0.1,
                                    betas=(0.9, 0.999))  # fmt: skip
    model, optim, _ = backend.prepare_train(model, optim, None)
    before = {k: v.clone() for k, v in backend.full_state_dict(model).items()}
    stepped = []
    for _ in range(2):
        backend.backward(model(torch.ones(1, 3)).sum(), model, optim)
        stepped.append(backend.optimizer_step(optim, model))
    assert stepped == [False, True]  # the second micro-step ends the accumulation
    assert world.step_state(model).global_steps == 1
    after = backend.full_state_dict(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
