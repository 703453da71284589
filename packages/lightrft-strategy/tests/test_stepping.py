"""Stepping semantics at world size 1: accumulation boundaries, non-finite gradients,
one global clipping norm, optimizer offload, prepare's shapes, collectives, print,
memory reports; offload_model/reload_model."""

from __future__ import annotations

import copy
import gc
import math
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

from lightrft.strategy import StrategyBase, get_strategy
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.strategy.fsdp2.backend import FSDP2Backend

from . import workers


def test_accumulation_steps_only_on_boundaries_and_per_model(fsdp2: StrategyBase) -> None:
    assert fsdp2.accumulated_gradient == 4  # 8 / (2 x 1 rank)
    actor = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    critic = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    a_opt, c_opt = fsdp2.create_optimizer(actor), fsdp2.create_optimizer(critic)
    stepped = [workers.grads_step(fsdp2, actor, a_opt, 1.0) for _ in range(3)]
    assert workers.grads_step(fsdp2, critic, c_opt, 1.0) is False  # critic counts on its own
    stepped.append(workers.grads_step(fsdp2, actor, a_opt, 1.0))
    assert stepped == [False, False, False, True]
    assert fsdp2.step_state(actor).global_steps == 1
    assert fsdp2.step_state(critic).global_steps == 0
    assert all(p.grad is None for p in actor.parameters())


def test_non_finite_gradients_skip_the_step(fsdp2: StrategyBase) -> None:
    model = fsdp2.prepare_model(workers.TinyRegressor(), is_training=True)
    optim = fsdp2.create_optimizer(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = [workers.grads_step(fsdp2, model, optim, math.inf) for _ in range(4)]
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
                workers.grads_step(strategy, model, optim, 1.0)
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
                workers.grads_step(strategy, model, optim, 1.0)
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
        workers.grads_step(fsdp2, model, optim, 1.0)
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


class _RecordingBackend(FSDP2Backend):
    def __init__(self, strategy: StrategyBase) -> None:
        super().__init__(strategy)
        self.moves: list[tuple[nn.Module, str]] = []

    def move_model(self, model: nn.Module, device: torch.device) -> None:
        self.moves.append((model, device.type))


class RecordingMoves(FSDP2Strategy):
    """Records the models the strategy hands to its backend's ``move_model``."""

    backend_class = _RecordingBackend

    @property
    def moves(self) -> list[tuple[nn.Module, str]]:
        return self.backend.moves  # type: ignore[attr-defined, no-any-return]


def test_offload_model_and_reload_model_leave_the_models_of_a_cpu_job_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FSDP2Strategy(device="cpu") as strategy:
        moves: list[nn.Module] = []
        move = strategy.backend.move_model
        monkeypatch.setattr(
            strategy.backend, "move_model", lambda m, d: (moves.append(m), move(m, d))
        )
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
