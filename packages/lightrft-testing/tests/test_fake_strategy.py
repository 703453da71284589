"""FakeStrategy behaves like a real backend at world size 1: the spec's example, the
same accumulation/clipping/skip semantics as an unsharded torch loop, collectives,
checkpoints with resume, the HF export, engine calls, and selection by configuration."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightrft.strategy import get_fake_strategy, get_strategy
from lightrft.strategy.checkpoint import CheckpointError
from lightrft.testing import FakeEngine, FakeStrategy, spec_examples


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.norm(x))))


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 2, generator=gen)


def test_the_spec_examples_run_as_written_on_the_fake(tmp_path: Path) -> None:
    third = spec_examples.run_example_3(tmp_path)
    assert third["type"] == "FakeStrategy" and third["grads"]
    namespace = argparse.Namespace(seed=7)
    assert get_fake_strategy(args=namespace).seed == 7  # upstream's keyword spelling
    assert third["latest"] == "global_step0"
    assert (tmp_path / "checkpoints" / "global_step0" / "model.pt").is_file()
    first = spec_examples.run_example_1({"backend": "fake", "train_batch_size": 8,
                                         "micro_train_batch_size": 2}, micro_batches=8)  # fmt: skip
    assert first["type"] == "FakeStrategy" and first["accumulated"] == 4
    assert first["steps"] == 2 and first["moved"]
    second = spec_examples.run_example_2({"backend": "fake"})
    assert second["type"] == "FakeStrategy" and second["ready"]
    assert second["accumulated"] == 8  # 32 / (4 micro x 1 rank)
    assert not torch.distributed.is_initialized()


def test_upstream_positional_construction_accumulates_from_the_start() -> None:
    strategy = FakeStrategy(42, 1.0, 2, 8, None)
    assert strategy.is_ready and strategy.accumulated_gradient == 4
    model = nn.Linear(4, 1)
    optimizer = strategy.create_optimizer(model, lr=0.1)
    stepped = []
    for _ in range(8):
        strategy.backward(model(torch.ones(2, 4)).sum(), model, optimizer)
        stepped.append(strategy.optimizer_step(optimizer, model, None))
    assert stepped == [False, False, False, True] * 2
    strategy.setup_distributed()  # again, as the spec's example 3 does: nothing changes
    assert strategy.accumulated_gradient == 4 and strategy.step_state(model).global_steps == 2


def test_selected_by_configuration_and_constructed_as_upstream() -> None:
    namespace = argparse.Namespace(backend="fake", seed=3, train_batch_size=4)
    by_config = get_strategy(namespace)
    assert type(by_config) is FakeStrategy and by_config.config.seed == 3
    assert by_config.args is namespace
    direct = FakeStrategy(5, 0.5, 2, 8, namespace)
    assert (direct.seed, direct.max_norm, direct.micro_train_batch_size) == (5, 0.5, 2)
    assert direct.train_batch_size == 8 and direct.config.backend == "fake"


def test_training_matches_a_plain_torch_loop_with_accumulation_and_clipping() -> None:
    """In fp32 (bf16, the default, is checked against FSDP2 below)."""
    strategy = FakeStrategy(seed=0, max_norm=0.2, micro_train_batch_size=4, train_batch_size=8,
                            actor_learning_rate=1e-2, lr_warmup_ratio=0.0, l2=0.0,
                            lr_scheduler="constant_with_warmup", precision="fp32")  # fmt: skip
    strategy.setup_distributed()
    assert strategy.accumulated_gradient == 2
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        model, None, None, None, max_steps=10
    )
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                  weight_decay=0.0)  # fmt: skip
    x, y = _data()
    norms = []
    for step in range(3):
        for k in range(2):
            batch = slice((2 * step + k) * 4, (2 * step + k + 1) * 4)
            loss = nn.functional.mse_loss(actor(x[batch]), y[batch])
            strategy.backward(loss, actor, optim)
            stepped = strategy.optimizer_step(optim, actor, sched)
            assert stepped == (k == 1)
            (nn.functional.mse_loss(reference(x[batch]), y[batch]) / 2).backward()
        norms.append(strategy.step_state(actor).last_grad_norm)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.2)
        ref_optim.step()
        ref_optim.zero_grad()
    assert max(norms) > 0.2  # clipping was active
    for (name, a), b in zip(
        actor.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_a_nonfinite_step_is_skipped_like_on_every_backend() -> None:
    strategy = FakeStrategy(train_batch_size=1, lr_scheduler="linear", lr_warmup_ratio=0.0)
    (model, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        nn.Linear(2, 1), None, None, None, max_steps=5
    )
    before = [p.detach().clone() for p in model.parameters()]
    lr = sched.get_last_lr()[0]
    strategy.backward(model(torch.ones(1, 2)).sum() * float("inf"), model, optim)
    assert strategy.optimizer_step(optim, model, sched) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert sched.get_last_lr()[0] == lr and strategy.step_state(model).skipped_steps == 1


def test_collectives_return_what_a_world_of_one_returns() -> None:
    strategy = get_fake_strategy()
    # an int stays an int under sum/max/min; a mean is a float
    for op, expected in [("mean", 3.0), ("sum", 3), ("max", 3), ("min", 3)]:
        out = strategy.all_reduce(3, op)
        assert out == expected and type(out) is type(expected), (op, out)
    assert type(strategy.all_reduce(3)) is float  # the default op is mean
    assert type(strategy.all_reduce(2.0, "sum")) is float
    assert strategy.all_reduce({"a": torch.tensor([1.0])})["a"].tolist() == [1.0]
    assert strategy.all_gather(2) == [2]
    assert strategy.all_gather(torch.ones(2, 3)).shape == (2, 3)
    assert (strategy.get_rank(), strategy.world_size, strategy.is_rank_0()) == (0, 1, True)


def test_checkpoints_resume_exactly_and_refuse_what_does_not_fit(tmp_path: Path) -> None:
    def run(steps: int, load: bool, save: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        strategy = FakeStrategy(seed=1, train_batch_size=4, micro_train_batch_size=4,
                                lr_warmup_ratio=0.5)  # fmt: skip
        torch.manual_seed(1)
        (model, optim, sched), *_ = strategy.prepare_models_and_optimizers(
            Net(), None, None, None, max_steps=6
        )
        x, y = _data()
        loader = strategy.setup_dataloader(list(zip(x, y, strict=True)), batch_size=4)
        if load:
            _, client = strategy.load_ckpt(model, tmp_path)
            assert client == {"note": "hi"}
        losses = []
        batches = iter(loader)
        for _ in range(steps):
            bx, by = next(batches)
            loss = nn.functional.mse_loss(model(bx), by)
            strategy.backward(loss, model, optim)
            strategy.optimizer_step(optim, model, sched)
            losses.append(loss.item())
        if save:
            strategy.save_ckpt(model, tmp_path, client_state={"note": "hi"})
        return losses, strategy.full_state_dict(model)

    full, full_state = run(6, load=False, save=False)
    first, _ = run(3, load=False, save=True)
    second, state = run(3, load=True, save=False)
    assert first + second == full
    assert all(torch.equal(state[k], full_state[k]) for k in state)
    metadata = json.loads((tmp_path / "global_step3" / "lightrft_checkpoint.json").read_text())
    assert metadata["backend"] == "fake" and metadata["world_size"] == 1

    other = FakeStrategy()
    with pytest.raises(CheckpointError, match=r"does not fit this model \(Linear\)"):
        other.load_ckpt(nn.Linear(3, 3), tmp_path, load_optimizer_states=False)


def test_save_model_writes_the_hf_format(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    strategy = get_fake_strategy()
    model = Net()
    strategy.save_model(model, None, tmp_path / "export")
    saved = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_engine_calls_work_with_the_fake_engine() -> None:
    strategy = get_fake_strategy(enable_engine_sleep=True, engine_sleep_level=2)
    model = Net()
    engine = strategy.setup_inference_engine(FakeEngine())
    strategy.update_engine_weights(model)
    assert set(engine.syncs[-1]) == {n for n, _ in model.named_parameters()}
    assert len(strategy.gather_and_generate([[1, 2], [3]])) == 2
    assert strategy.maybe_sleep_inference_engine() is True
    strategy.wakeup_inference_engine()
    strategy.update_engine_weights(model)
    assert len(strategy.gather_and_generate([[1]])) == 1


def test_importing_it_needs_only_torch() -> None:
    code = (
        "import sys\n"
        "from lightrft.testing import FakeStrategy, FakeEngine, get_fake_strategy\n"
        "s = get_fake_strategy(); s.setup_distributed()\n"
        "heavy = {'deepspeed', 'vllm', 'sglang', 'transformers'} & set(sys.modules)\n"
        "print(sorted(heavy), s.device)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] cpu"


def test_moving_average_updates_once_per_optimizer_step_as_upstream_trainers_call_it() -> None:
    """Upstream trainers call moving_average after every micro-batch; the EMA moves
    once per optimizer step, not once per call (upstream DeepSpeed counts calls)."""
    strategy = FakeStrategy(0, 1.0, 2, 8, None)  # 4 micro-batches per step
    model, ema = nn.Linear(4, 1), nn.Linear(4, 1)
    ema.load_state_dict(model.state_dict())
    expected = {k: v.clone() for k, v in ema.state_dict().items()}
    optimizer = strategy.create_optimizer(model, lr=0.1)
    updates = []
    for _ in range(8):
        strategy.backward(model(torch.ones(2, 4)).sum(), model, optimizer)
        if strategy.optimizer_step(optimizer, model, None):
            expected = {k: 0.5 * expected[k] + 0.5 * v for k, v in model.state_dict().items()}
        updates.append(strategy.moving_average(model, ema, beta=0.5))
    assert updates == [False, False, False, True] * 2
    for name, value in ema.state_dict().items():
        torch.testing.assert_close(value, expected[name])
    frozen, copy = nn.Linear(4, 1), nn.Linear(4, 1)  # never stepped: every call updates
    assert strategy.moving_average(frozen, copy, 0.5) and strategy.moving_average(frozen, copy)


def _train_losses(backend: str, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    strategy = get_strategy({"backend": backend, "precision": precision, "device": "cpu",
                             "seed": 0, "micro_train_batch_size": 4, "train_batch_size": 8,
                             "actor_learning_rate": 1e-2, "max_norm": 0.5})  # fmt: skip
    torch.manual_seed(0)
    (actor, optim, sched), *_ = strategy.prepare_models_and_optimizers(Net(), None, None, None,
                                                                       max_steps=6)  # fmt: skip
    x, y = _data()
    losses = []
    for i in range(8):
        batch = slice(4 * i, 4 * i + 4)
        loss = nn.functional.mse_loss(actor(x[batch]).float(), y[batch])
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)
        losses.append(loss.item())
    state = strategy.full_state_dict(actor)
    strategy.close()
    return losses, state


def test_the_fake_computes_in_the_configured_precision_as_fsdp2_does() -> None:
    """bf16 (the default): bf16 forward, fp32 master weights, as FSDP2 on one rank."""
    fake, fake_state = _train_losses("fake", "bf16")
    fsdp2, fsdp2_state = _train_losses("fsdp2", "bf16")
    fp32, _ = _train_losses("fake", "fp32")
    assert fake != fp32, "the fake computed bf16 in fp32"
    torch.testing.assert_close(fake, fsdp2, rtol=1e-2, atol=1e-3)
    gap_to_fp32 = max(abs(a - b) for a, b in zip(fake, fp32, strict=True))
    gap_to_fsdp2 = max(abs(a - b) for a, b in zip(fake, fsdp2, strict=True))
    assert gap_to_fsdp2 < gap_to_fp32, (gap_to_fsdp2, gap_to_fp32)
    for name, value in fake_state.items():
        assert value.dtype == torch.float32, name  # masters stay fp32
        torch.testing.assert_close(value, fsdp2_state[name], rtol=2e-2, atol=2e-3)
