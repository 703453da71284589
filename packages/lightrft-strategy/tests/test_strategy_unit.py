"""StrategyBase behaviour in one process: factory, registry, compatibility surface,
launch environment, optimizer groups, schedules, stepping semantics."""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import math
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import lightrft.strategy as strategy_pkg
from lightrft.config import ConfigError
from lightrft.strategy import (
    StrategyBase,
    StrategyConfig,
    UnknownBackendError,
    get_backend,
    get_strategy,
    register_backend,
)
from lightrft.strategy import registry as backend_registry
from lightrft.strategy.distributed import LaunchEnv
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.strategy.optim import build_scheduler, parameter_groups

from . import workers


@pytest.fixture
def fsdp2() -> Iterator[StrategyBase]:
    strategy = get_strategy(workers.config())  # ready when built
    yield strategy
    strategy.close()


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
    strategy = get_strategy(args)
    assert isinstance(strategy, FSDP2Strategy)
    assert strategy.config.seed == 3
    assert strategy.args is args
    by_keyword = get_strategy(args=args)  # upstream's get_strategy(args=...) spelling
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
        assert type(get_strategy({})).__name__ == "DeepspeedStrategy"


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


# -- launch environment ----------------------------------------------------------------
def test_launch_env_from_torchrun() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"}  # fmt: skip
    launch = LaunchEnv.from_environ(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (
        3,
        1,
        4,
        2,
    )
    assert (launch.master_addr, launch.master_port, launch.launcher) == (
        "10.0.0.1",
        29999,
        "torchrun",
    )


def test_launch_env_from_slurm() -> None:
    env = {
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "node1",
        "MASTER_PORT": "12345",
    }  # fmt: skip
    launch = LaunchEnv.from_environ(env)
    layout = (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size)
    assert layout == (5, 1, 8, 4)
    assert launch.launcher == "slurm"
    # the batch script itself (no srun step) is a single process
    del env["SLURM_STEP_NUM_TASKS"]
    assert LaunchEnv.from_environ(env).launcher == "single"


def test_launch_env_single_process() -> None:
    launch = LaunchEnv.from_environ({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4: must lie in \[0, WORLD_SIZE=4\)"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, r"RANK='x': environment variable must be an integer"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "export MASTER_PORT"),
    ],
)
def test_launch_env_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LaunchEnv.from_environ(env)


def test_world_size_check_runs_at_setup() -> None:
    with pytest.raises(ConfigError, match="sp_size=2: does not divide the world size 1"):
        get_strategy(workers.config(sp_size=2))  # setup runs in the constructor
    assert not torch.distributed.is_initialized()  # checked before any rendezvous
    deferred = get_strategy(workers.config(sp_size=2), defer_setup=True)
    with pytest.raises(ConfigError, match="sp_size=2: does not divide the world size 1"):
        deferred.setup_distributed()
    assert not torch.distributed.is_initialized()


def test_cuda_requested_without_cuda_is_an_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device='cuda': CUDA is not available here"):
        get_strategy(workers.config(device="cuda"))


# -- optimizer and schedule ------------------------------------------------------------
def test_weight_decay_excludes_biases_and_norms() -> None:
    model = workers.TinyRegressor()
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(n.endswith(".weight") and ".norm." not in n for n in decayed)
    assert {names[id(p)] for p in no_decay["params"]} >= {"layers.0.norm.weight", "head.bias"}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


@pytest.mark.parametrize(
    ("kind", "at_end"),
    [("cosine_with_min_lr", 0.1), ("cosine", 0.0), ("linear", 0.0), ("constant_with_warmup", 1.0)],
)
def test_schedules_warm_up_then_follow_their_shape(kind: str, at_end: float) -> None:
    optim = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(optim, StrategyConfig(lr_warmup_ratio=0.1, lr_scheduler=kind), 100)
    lrs = []
    for _ in range(100):
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.1)  # warmup from 0: 10 steps
    assert lrs[10] == pytest.approx(1.0)
    assert optim.param_groups[0]["lr"] == pytest.approx(at_end, abs=1e-9)
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(lrs[10:]))


# -- stepping semantics at world size 1 --------------------------------------------------
def _grads_step(
    strategy: StrategyBase, model: nn.Module, optim: torch.optim.Optimizer, loss_scale: float
) -> bool:
    x = torch.ones(2, workers.DIM)
    loss = model(x).pow(2).mean() * loss_scale
    strategy.backward(loss, model, optim)
    return strategy.optimizer_step(optim, model, None)


def test_accumulation_steps_only_on_boundaries_and_per_model(fsdp2: StrategyBase) -> None:
    assert fsdp2.accumulated_gradient == 4  # 8 / (2 x 1 rank)
    actor = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    critic = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    a_opt, c_opt = fsdp2.create_optimizer(actor), fsdp2.create_optimizer(critic)
    stepped = [_grads_step(fsdp2, actor, a_opt, 1.0) for _ in range(3)]
    assert _grads_step(fsdp2, critic, c_opt, 1.0) is False  # critic counts on its own
    stepped.append(_grads_step(fsdp2, actor, a_opt, 1.0))
    assert stepped == [False, False, False, True]
    assert fsdp2.step_state(actor).global_steps == 1
    assert fsdp2.step_state(critic).global_steps == 0
    assert all(p.grad is None for p in actor.parameters())


def test_non_finite_gradients_skip_the_step(fsdp2: StrategyBase) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = [_grads_step(fsdp2, model, optim, math.inf) for _ in range(4)]
    assert results == [False] * 4
    state = fsdp2.step_state(model)
    assert (state.skipped_steps, state.global_steps) == (1, 0)
    assert not math.isfinite(state.last_grad_norm or 0.0)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name


def test_clipping_uses_one_global_norm(fsdp2: StrategyBase) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):
        fsdp2.backward(model(torch.ones(2, workers.DIM)).pow(2).mean() * 100, model, optim)
        fsdp2.optimizer_step(optim, model, None)
    fsdp2.backward(model(torch.ones(2, workers.DIM)).pow(2).mean() * 100, model, optim)
    grads = [p.grad.full_tensor().clone() for p in model.parameters()]  # type: ignore[union-attr]
    raw_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    before = [p.detach().full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    fsdp2.optimizer_step(optim, model, None)
    after = [p.detach().full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    moved = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(b - a) for a, b in zip(before, after, strict=True)])
    )
    assert fsdp2.step_state(model).last_grad_norm == pytest.approx(float(raw_norm), rel=1e-5)
    assert float(moved) == pytest.approx(fsdp2.max_norm, rel=1e-4)  # SGD lr 1: step = clipped grad


@pytest.mark.parametrize("max_norm", [0.0, -1.0], ids=["zero", "negative"])
def test_max_norm_zero_or_negative_disables_clipping(max_norm: float) -> None:
    """A gradient norm far above any clip threshold is applied as it is: the prepared
    model follows a plain torch model stepped on the same, unclipped, gradients. (SGD,
    whose step is proportional to the gradient; Adam's step hardly depends on the
    gradient's scale, so it would not show a clip.)"""
    with get_strategy(workers.config(max_norm=max_norm, train_batch_size=2)) as strategy:
        assert strategy.max_norm == max_norm and strategy.accumulated_gradient == 1
        reference = workers.TinyRegressor()
        model = strategy.prepare_model(copy.deepcopy(reference), is_training=True)
        optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=1e-3)
        x = torch.linspace(-1, 1, 2 * workers.DIM).reshape(2, workers.DIM)
        for _ in range(3):
            strategy.backward(model(x).pow(2).mean() * 100, model, optim)
            assert strategy.optimizer_step(optim, model, None)
            reference(x).pow(2).mean().mul(100).backward()  # type: ignore[no-untyped-call]
            grads = [p.grad for p in reference.parameters() if p.grad is not None]
            raw_norm = float(torch.nn.utils.get_total_norm(grads))
            ref_optim.step()
            ref_optim.zero_grad()
            assert raw_norm > 10.0  # over 30x the other tests' max_norm: a clip would show
            assert strategy.step_state(model).last_grad_norm == pytest.approx(raw_norm, rel=1e-5)
            workers.assert_states_close(
                strategy.full_state_dict(model), reference.state_dict(), rtol=1e-5, atol=1e-6
            )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value; a plain tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def test_optimizer_offload_round_trip_is_harmless_on_cpu() -> None:
    """On a CPU job the state already lives in CPU memory: offload and load keep the
    very tensors (no copy), and training goes on exactly as without the calls."""

    def run(offload: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        with get_strategy(workers.config()) as strategy:
            model = strategy.prepare_model(workers.TinyRegressor(), is_training=True)
            optim = strategy.create_optimizer(model)
            for _ in range(4):
                _grads_step(strategy, model, optim, 1.0)
            if offload:
                states = [dict(state) for state in optim.state.values()]
                values = [{k: _full(v).clone() for k, v in state.items()} for state in states]
                strategy.maybe_offload_optimizer(optim)
                strategy.maybe_load_optimizer(optim)
                after = list(optim.state.values())
                for moved, before, value in zip(after, states, values, strict=True):
                    assert set(moved) == {"step", "exp_avg", "exp_avg_sq"}
                    for key, tensor in moved.items():
                        assert tensor is before[key], key  # the very tensor: no copy made
                        assert tensor.device.type == "cpu", key
                        assert torch.equal(_full(tensor), value[key]), key
            for _ in range(8):
                _grads_step(strategy, model, optim, 1.0)
            assert strategy.step_state(model).global_steps == 3
            state = strategy.full_state_dict(model)
            optim_state = [{k: _full(v) for k, v in st.items()} for st in optim.state.values()]
        return state, optim_state

    (with_calls, with_calls_optim), (without, without_optim) = run(True), run(False)
    workers.assert_states_close(with_calls, without, rtol=0, atol=0)
    for a, b in zip(with_calls_optim, without_optim, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_optimizer_state_moves_where_it_is_sent_and_not_under_adam_offload(
    fsdp2: StrategyBase,
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    for _ in range(4):
        _grads_step(fsdp2, model, optim, 1.0)
    fsdp2.maybe_load_optimizer(optim, device="meta")  # a device that exists on every host
    for state in optim.state.values():
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"  # the step count never moves
    fsdp2.config.adam_offload = True  # DeepSpeed keeps such state on the CPU itself
    fsdp2.maybe_load_optimizer(optim, device="cpu")
    assert all(s["exp_avg"].device.type == "meta" for s in optim.state.values())


def test_prepare_shapes(fsdp2: StrategyBase) -> None:
    model, opt, sched = workers.TinyRegressor(), None, None
    opt = torch.optim.AdamW(model.parameters())
    triple = fsdp2.prepare((model, opt, sched))
    assert isinstance(triple, tuple) and triple[0] is model
    assert all(p.__class__.__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
    several = fsdp2.prepare(workers.TinyRegressor(), None, workers.TinyRegressor())
    assert isinstance(several, list) and several[1] is None and not several[0].training
    with pytest.raises(ValueError, match=r"takes \(model, optimizer, scheduler\) triples"):
        fsdp2.prepare((workers.TinyRegressor(), opt))
    (actor, a_opt, a_sched), critic, rewards, _ = fsdp2.prepare_models_and_optimizers(
        *(workers.TinyRegressor(), None),
        [workers.TinyRegressor() for _ in range(2)],
        *(workers.TinyRegressor(), None, 10),
    )
    assert critic == (None, None, None)
    assert isinstance(rewards, list) and len(rewards) == 2
    assert a_sched is not None and isinstance(a_opt, torch.optim.AdamW)
    assert fsdp2.optimizer_of(actor) == (a_opt, a_sched)


def test_collectives_at_world_size_one(fsdp2: StrategyBase) -> None:
    assert fsdp2.all_reduce(3) == 3 and isinstance(fsdp2.all_reduce(3, "sum"), int)
    assert fsdp2.all_reduce(3, "mean") == 3.0
    assert fsdp2.all_reduce({"a": 1.5}) == {"a": 1.5}
    out = fsdp2.all_reduce(torch.tensor([1, 2]), "max")
    assert out.dtype == torch.int64 and out.tolist() == [1, 2]
    assert fsdp2.all_gather(2) == [2]
    assert fsdp2.all_gather(torch.ones(2, 3)).shape == (2, 3)
    with pytest.raises(ValueError, match="op='avg' is not one of"):
        fsdp2.all_reduce(1.0, "avg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        fsdp2.all_reduce("x")
    source = torch.ones(2)
    fsdp2.all_reduce(source, "sum").add_(1)  # the result is never an alias of the input
    assert source.tolist() == [1.0, 1.0]
    assert fsdp2.all_gather(torch.tensor(3.0)).shape == (1,)  # 0-d gathers to (world,)


def test_print_reaches_stdout_when_logging_is_unconfigured(fsdp2: StrategyBase) -> None:
    code = (
        "from lightrft.strategy import get_strategy\n"
        "s = get_strategy({'backend': 'fsdp2'})\n"
        "s.print('hello', 3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "hello 3", out.stderr


def test_loading_a_checkpoint_into_another_model_names_the_mismatch(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    from lightrft.strategy import CheckpointError

    small = fsdp2.prepare_model(workers.TinyRegressor(blocks=2), is_training=True)
    fsdp2.save_ckpt(small, tmp_path, tag="small", optimizer=fsdp2.create_optimizer(small))
    bigger = fsdp2.prepare_model(workers.TinyRegressor(blocks=3), is_training=True)
    with pytest.raises(CheckpointError, match=r"does not fit this model.*layers\.2"):
        fsdp2.load_ckpt(bigger, tmp_path, load_optimizer_states=False)


def test_report_memory_and_cache_clearing_work_on_cpu(
    fsdp2: StrategyBase, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="lightrft.strategy.print"):
        figures = fsdp2.report_memory("after setup")
    assert figures["cpu_max_rss_gib"] > 0.01
    assert "allocated_gib" not in figures  # no accelerator figures on CPU
    assert any("after setup memory: cpu_max_rss_gib=" in r.getMessage() for r in caplog.records)

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    was_enabled = gc.isenabled()
    gc.disable()  # only sync_and_clear_cache may collect the cycle
    try:
        cycle = Cycle()
        alive = weakref.ref(cycle)
        del cycle
        assert alive() is not None  # a reference cycle outlives its last name
        fsdp2.sync_and_clear_cache()
        assert alive() is None  # freed by the garbage collection it runs
    finally:
        if was_enabled:
            gc.enable()


def test_checkpoint_holds_optimizer_from_create_optimizer_and_client_state(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    sched = fsdp2.create_scheduler(optim, 10)
    assert fsdp2.optimizer_of(model) == (optim, sched)
    for _ in range(4):
        _grads_step(fsdp2, model, optim, 1.0)
    fsdp2.save_ckpt(model, tmp_path, client_state={"episode": 7, "t": torch.arange(3)})
    meta = json.loads((tmp_path / "global_step1" / "lightrft_checkpoint.json").read_text())
    assert meta["has_optimizer"] and meta["has_scheduler"]
    _, client = fsdp2.load_ckpt(model, tmp_path)
    assert client["episode"] == 7 and client["t"].tolist() == [0, 1, 2]


def test_saving_before_the_first_step_leaves_the_optimizer_fresh(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    fsdp2.save_ckpt(model, tmp_path, tag="init")
    assert not optim.state  # torch's state-dict helper would have stepped it
    fsdp2.load_ckpt(model, tmp_path)
    assert not optim.state


def test_load_module_only_restores_weights_and_nothing_else(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
        _grads_step(fsdp2, model, optim, 1.0)
    fsdp2.save_ckpt(model, tmp_path)
    saved = fsdp2.full_state_dict(model)

    fresh = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fresh_optim = fsdp2.create_optimizer(fresh)
    fresh_loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    fsdp2.load_ckpt(fresh, tmp_path, load_module_only=True)
    workers.assert_states_close(fsdp2.full_state_dict(fresh), saved, rtol=0, atol=0)
    assert fresh_loader.state_dict()["consumed_samples"] == 0
    assert fsdp2.step_state(fresh).global_steps == 0
    assert not fresh_optim.state


def test_a_loader_created_after_loading_resumes_too(fsdp2: StrategyBase, tmp_path: Path) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fsdp2.create_optimizer(model)
    loader = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    fsdp2.save_ckpt(model, tmp_path, tag="t")
    del loader, batches
    fsdp2.load_ckpt(model, tmp_path)
    late = fsdp2.setup_dataloader(workers.RegressionTask(), batch_size=2)
    assert late.state_dict()["consumed_samples"] == 6


def test_rotation_never_deletes_the_checkpoint_latest_names(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    fsdp2.create_optimizer(model)
    fsdp2.save_ckpt(model, tmp_path, tag="step1")
    fsdp2.save_ckpt(model, tmp_path, tag="best", save_latest=False, max_num=1)
    assert (tmp_path / "latest").read_text().strip() == "step1"
    assert fsdp2.load_ckpt(model, tmp_path)[0].endswith("step1")


def test_save_refuses_to_replace_a_foreign_directory_and_bad_max_num(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    from lightrft.strategy import CheckpointError

    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_bytes(b"an export")
    with pytest.raises(CheckpointError, match="is not a LightRFT checkpoint"):
        fsdp2.save_ckpt(model, tmp_path, tag="final")
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == b"an export"
    with pytest.raises(ValueError, match="max_num=0 must be >= 1"):
        fsdp2.save_ckpt(model, tmp_path, max_num=0)
    assert not (tmp_path / "global_step0").exists()


class RecordingMoves(FSDP2Strategy):
    """Records the models the strategy hands to its ``_move_model`` backend hook."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.moves: list[tuple[nn.Module, str]] = []

    def _move_model(self, model: nn.Module, device: torch.device) -> None:
        self.moves.append((model, device.type))


def test_offload_model_and_reload_model_leave_the_models_of_a_cpu_job_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FSDP2Strategy(device="cpu") as strategy:
        moves: list[nn.Module] = []
        move = strategy._move_model
        monkeypatch.setattr(strategy, "_move_model", lambda m, d: (moves.append(m), move(m, d)))
        sharded = strategy.prepare_model(workers.TinyRegressor(), is_training=True)
        models = [torch.nn.Linear(3, 3), sharded]
        params = [list(m.parameters()) for m in models]
        before = [[_full(p.detach()).clone() for p in ps] for ps in params]
        strategy.offload_model(models)  # a list, as upstream's FSDP strategy takes
        strategy.offload_model(models[0])
        strategy.reload_model(models)
        strategy.reload_model(models[1])
        assert moves == []  # nothing to move off a CPU job
        for model, ps, values in zip(models, params, before, strict=True):
            now = list(model.parameters())
            assert all(a is b for a, b in zip(now, ps, strict=True))  # the same tensors
            assert all(p.device.type == "cpu" for p in now)
            assert all(torch.equal(_full(p.detach()), v) for p, v in zip(now, values, strict=True))


def test_offload_model_and_reload_model_move_every_model_of_an_accelerator_job() -> None:
    with RecordingMoves(device="cpu") as strategy:
        strategy.device = torch.device("cuda")  # as on a GPU job; the hook moves nothing
        actor, critic = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        strategy.offload_model([actor, critic])
        strategy.reload_model([actor, critic])
        strategy.offload_model(actor)
        strategy.reload_model(actor)
    assert strategy.moves == [
        (actor, "cpu"), (critic, "cpu"), (actor, "cuda"), (critic, "cuda"),
        (actor, "cpu"), (actor, "cuda"),
    ]  # fmt: skip
