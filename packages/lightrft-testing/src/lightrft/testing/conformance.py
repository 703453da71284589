"""The conformance suite: what every strategy backend must do, checked by behaviour.

A backend runs it by subclassing :class:`StrategyConformance` in a test module and
naming its configuration::

    from lightrft.testing.conformance import StrategyConformance

    class TestMyBackend(StrategyConformance):
        backend = {"backend": "mine"}   # fields for get_strategy (a registered name)
        world_size = 2                   # ranks per check (real gloo processes)

Each check starts ``world_size`` real processes (1: still a separate process), builds
the strategy with :func:`lightrft.strategy.get_strategy` and compares what it did with
a plain single-process torch computation. Tolerances: fp32, rtol 1e-5 / atol 1e-6
against the reference; resume bit for bit. A failing check is a bug in the backend.
A new check is a minor version bump of lightrft-testing: pin it exactly.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from lightrft.testing import harness
from lightrft.testing.models import RegressionTask, TinyRegressor

#: The suite's model and task (from :mod:`lightrft.testing.models`): one residual block,
#: so a 2-rank FSDP2 run shards a block, the head and the norm.
MODEL = partial(TinyRegressor, dim=8, outputs=2, blocks=1)
TASK = partial(RegressionTask, size=64, dim=8, outputs=2, seed=99)
#: Optimizer steps the schedules of the checks run over.
MAX_STEPS = 8


def _config(backend: dict[str, Any], world_size: int, **changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "device": "cpu", "precision": "fp32", "seed": 0, "micro_train_batch_size": 2,
        "train_batch_size": 4 * world_size, "max_norm": 0.05, "actor_learning_rate": 1e-2,
        "lr_warmup_ratio": 0.5, "lr_scheduler": "cosine_with_min_lr", "l2": 0.05,
    }  # fmt: skip
    cfg.update(backend)
    cfg.update(changes)
    return cfg


def _readiness(cfg: dict[str, Any]) -> dict[str, Any]:
    """What ``get_strategy`` hands back, before any other call; then a second
    ``setup_distributed()``; and a strategy built with ``defer_setup=True`` (before the
    first, so it finds no group; set up after it, so it joins the first's group: a job
    that closes its group and opens another on the same port can race)."""
    import os

    import torch.distributed as dist

    from lightrft.strategy import get_strategy

    deferred = get_strategy(cfg, defer_setup=True)
    out: dict[str, Any] = {}
    try:
        deferred.create_optimizer(MODEL())
    except Exception as exc:
        out["deferred_error"] = f"{type(exc).__name__}: {exc}"
    else:
        out["deferred_error"] = None
    strategy = get_strategy(cfg)
    out.update(
        ready=bool(getattr(strategy, "is_ready", False)),
        world=strategy.world_size,
        launched=int(os.environ.get("WORLD_SIZE", "1")),
        group=dist.get_world_size() if dist.is_initialized() else None,
    )
    if not out["ready"]:
        return out  # the check fails on "ready"; nothing else is meaningful
    out["accumulated"] = strategy.accumulated_gradient
    torch.manual_seed(1234)
    torch.rand(3)
    before = torch.get_rng_state()
    strategy.setup_distributed()  # again: must change nothing (no re-seed, no new group)
    out["reseeded"] = not torch.equal(before, torch.get_rng_state())
    out["again"] = (strategy.world_size, strategy.accumulated_gradient)
    deferred.setup_distributed()
    out["deferred_then_setup"] = (deferred.world_size, deferred.accumulated_gradient)
    deferred.close()
    strategy.close()
    return out


def _train(cfg: dict[str, Any], steps: int, **options: Any) -> dict[str, Any]:
    """Rank function: :func:`lightrft.testing.harness.train` on the suite's model and task."""
    return harness.train(
        cfg, steps, model=MODEL, task=TASK, max_steps=MAX_STEPS,
        client_state={"steps": steps}, **options,
    )  # fmt: skip


def _reference(cfg: dict[str, Any], steps: int, used: list[list[list[int]]]) -> dict[str, Any]:
    """The same steps in plain fp32 torch, with upstream's schedule written out (not the
    strategy's ``build_scheduler``)."""
    warmup = math.ceil(MAX_STEPS * cfg["lr_warmup_ratio"])
    return harness.reference(
        cfg, steps, used, model=MODEL, task=TASK,
        lr_factor=partial(harness.upstream_lr_factor, warmup=warmup, total=MAX_STEPS),
    )  # fmt: skip


def _collectives(cfg: dict[str, Any]) -> dict[str, Any]:
    from lightrft.strategy import get_strategy

    strategy = get_strategy(cfg)
    rank = strategy.get_rank()
    out = {
        "mean": strategy.all_reduce(float(rank)),
        "sum_int": strategy.all_reduce(rank + 1, "sum"),
        "max_tensor": strategy.all_reduce(torch.tensor([rank, -rank]), "max"),
        "dict": strategy.all_reduce({"a": 1.0, "b": torch.ones(2)}),
        "gather": strategy.all_gather(torch.full((1, 2), float(rank))),
        "gather_num": strategy.all_gather(rank),
        "rank": rank,
        "world": strategy.world_size,
    }
    strategy.close()
    return out


def _rotation(cfg: dict[str, Any], save_dir: str) -> list[str]:
    from lightrft.strategy import get_strategy

    strategy = get_strategy(cfg)
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(MODEL(), None, None, None, None, 8)
    for tag in ("a", "b", "c"):
        strategy.save_ckpt(actor, save_dir, tag=tag, max_num=2)
    errors = []
    from lightrft.strategy.checkpoint import CheckpointNotFoundError

    try:
        strategy.load_ckpt(actor, Path(save_dir) / "nothing-here")
    except CheckpointNotFoundError as exc:
        errors.append(str(exc))
    strategy.close()
    return errors


def _engine(cfg: dict[str, Any]) -> dict[str, Any]:
    from lightrft.engines import SamplingParams
    from lightrft.strategy import get_strategy
    from lightrft.testing.fake_engine import FakeEngine, tensor_digest

    strategy = get_strategy(cfg)
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(MODEL(), None, None, None, None, 8)
    engine = FakeEngine(expected_weights=[n for n, _ in MODEL().named_parameters()])
    strategy.setup_inference_engine(engine)
    strategy.update_engine_weights(actor, bucket_bytes=256)
    full = strategy.full_state_dict(actor)
    rank = strategy.get_rank()
    prompts = [[rank + 1] * (rank + 1) for _ in range(rank + 1)]  # uneven counts
    outputs = strategy.gather_and_generate(prompts, SamplingParams(max_new_tokens=2))
    strategy.close()
    return {
        "record": {n: r.sha256 for n, r in engine.syncs[-1].items()},
        "full": {n: tensor_digest(t) for n, t in full.items()} if rank == 0 else None,
        "prompts": prompts,
        "returned": [o.prompt_token_ids for o in outputs],
    }


def _loaders(cfg: dict[str, Any]) -> dict[str, Any]:
    """Two loaders from the same seed, and one resumed after 3 batches."""
    from lightrft.strategy import get_strategy

    strategy = get_strategy(cfg)
    data = TASK(size=24)
    order = [[int(i) for i in b[0]] for b in strategy.setup_dataloader(data, batch_size=2)]
    again = [[int(i) for i in b[0]] for b in strategy.setup_dataloader(data, batch_size=2)]
    consumed = 3 * 2 * strategy.world_size  # global samples of 3 batches
    tail = strategy.setup_dataloader(data, batch_size=2, consumed_samples=consumed)
    resumed = [[int(i) for i in b[0]] for b in tail]
    strategy.close()
    return {"order": order, "again": again, "resumed": resumed}


def _spec_examples(cfg: dict[str, Any], backend: dict[str, Any]) -> dict[str, Any]:
    """The specification's examples 1 and 2, one after the other in this rank (the
    second joins the group the first made: re-creating a group on the same port at
    once races with the ranks still tearing the old one down)."""
    import torch.distributed as dist

    from lightrft.testing import spec_examples

    first = spec_examples.run_example_1(cfg, micro_batches=4, close=False)
    second = spec_examples.run_example_2(backend)
    # example 2 ends in torch's new_group, which has no barrier: without one here,
    # rank 0 (the rendezvous store's host) can leave while rank 1 still reads the store
    # (the fake strategy makes no process group)
    if dist.is_initialized():
        dist.barrier()
    return {"example_1": first, "example_2": second}


def _load_error(cfg: dict[str, Any], load_dir: str) -> tuple[str, bool]:
    """The error ``load_ckpt`` raised (or ``"loaded"``), and whether the model's weights
    are still those it had before the call (compared in full, on rank 0)."""
    from lightrft.strategy import get_strategy

    strategy = get_strategy(cfg)
    (actor, _, _), *_ = strategy.prepare_models_and_optimizers(MODEL(), None, None, None, None, 8)
    try:
        # cloned: a plain module's state dict holds its very tensors, which a load changes
        before = {k: v.clone() for k, v in strategy.full_state_dict(actor).items()}
        try:
            strategy.load_ckpt(actor, load_dir)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = "loaded"
        after = strategy.full_state_dict(actor)
        unchanged = before.keys() == after.keys() and all(
            torch.equal(after[k], v) for k, v in before.items()
        )
    finally:
        strategy.close()
    return error, unchanged


class StrategyConformance:
    """Subclass with ``backend`` (get_strategy fields) and ``world_size``."""

    backend: ClassVar[dict[str, Any]] = {}
    world_size: ClassVar[int] = 1
    timeout: ClassVar[float] = 300.0

    def _run(self, fn: Any, *args: Any, world_size: int | None = None, **kw: Any) -> list[Any]:
        from lightrft.testing.launcher import run_distributed

        return run_distributed(
            fn, world_size or self.world_size, *args,
            init_process_group=False, timeout=self.timeout, **kw,
        )  # fmt: skip

    def config(self, **changes: Any) -> dict[str, Any]:
        if not self.backend:
            pytest.fail(f"{type(self).__name__} must set `backend` (get_strategy fields)")
        return _config(self.backend, self.world_size, **changes)

    def test_get_strategy_returns_a_ready_strategy(self) -> None:
        """Joined the job when built (as upstream's constructor does); a second
        setup_distributed() is a no-op; a deferred one refuses work until set up."""
        accumulation = 2  # train_batch_size 4 x world / (micro 2 x world)
        for r in self._run(_readiness, self.config()):
            assert r["ready"], "get_strategy returned a strategy that is not set up"
            assert r["world"] == r["launched"] == self.world_size, r
            assert r["group"] in (None, self.world_size), r
            assert r["accumulated"] == accumulation, r
            assert not r["reseeded"], "a second setup_distributed() re-seeded"
            assert r["again"] == (self.world_size, accumulation), r
            assert r["deferred_error"] and "setup_distributed()" in r["deferred_error"], r
            assert r["deferred_then_setup"] == (self.world_size, accumulation), r

    def test_the_specifications_usage_examples_run(self) -> None:
        """Examples 1 and 2 of the specification, their text executed as written
        (see :mod:`lightrft.testing.spec_examples`), on this backend."""
        backend = {**self.backend, "device": "cpu"}
        for r in self._run(_spec_examples, self.config(), backend):
            first, second = r["example_1"], r["example_2"]
            assert (first["world"], first["accumulated"]) == (self.world_size, 2), first
            assert first["steps"] == 2 and first["moved"], "example 1 did not train"
            assert second["ready"] and second["world"] == self.world_size, second
            assert second["accumulated"] == 32 // (4 * self.world_size), second
            assert second["seed"] == 42 and second["bf16"] is True, second

    def test_training_matches_the_unsharded_reference(self) -> None:
        """Accumulation (2 micro-batches), clipping (active), weight decay on matrices,
        upstream's warmup + cosine schedule (the reference writes it out itself)."""
        cfg = self.config()
        ranks = self._run(_train, cfg, 4)
        first = ranks[0]
        assert first["stepped"] == [False, True] * 4, "optimizer_step's boundary"
        assert all(r["losses"] == first["losses"] for r in ranks), "ranks disagree on loss"
        used = [i for r in ranks for batch in r["used"] for i in batch]
        # 16 samples a rank, within the first epoch: no sample twice, on one rank or two
        assert len(used) == 16 * self.world_size, len(used)
        assert len(set(used)) == len(used), "a sample was used twice in one epoch"
        ref = _reference(cfg, 4, [r["used"] for r in ranks])
        torch.testing.assert_close(first["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        state = {k: v.float() for k, v in first["state"].items()}
        for name, value in ref["state"].items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)

    def test_bf16_training_stays_close_to_the_fp32_reference(self) -> None:
        """``precision="bf16"``: bf16 compute, fp32 master weights; close to the fp32
        reference (bf16 rounding: 2e-2 relative), not equal to it."""
        cfg = self.config(precision="bf16")
        ranks = self._run(_train, cfg, 4)
        first = ranks[0]
        ref = _reference(cfg, 4, [r["used"] for r in ranks])
        torch.testing.assert_close(first["losses"], ref["losses"], rtol=2e-2, atol=2e-3)
        assert first["losses"] != ref["losses"], "bf16 training computed in fp32"
        for name, value in first["state"].items():
            assert value.dtype == torch.float32, f"{name}: master weights in {value.dtype}"
        # as a whole: a parameter near 0 (a bias) has no meaningful relative error alone
        got = torch.cat([first["state"][name].flatten() for name in ref["state"]])
        want = torch.cat([value.flatten() for value in ref["state"].values()])
        error = torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
        assert error <= 2e-2, f"bf16 weights {float(error):.3g} (relative) from the reference"

    def test_resume_is_exact(self, tmp_path: Path) -> None:
        cfg = self.config()
        full = self._run(_train, cfg, 4)
        self._run(_train, cfg, 2, save_dir=str(tmp_path))
        second = self._run(_train, cfg, 2, load_dir=str(tmp_path))
        assert second[0]["client"] == {"steps": 2}
        assert second[0]["losses"] == full[0]["losses"][2:]
        assert second[0]["lr"] == full[0]["lr"]
        for name, value in full[0]["state"].items():
            assert torch.equal(second[0]["state"][name], value), name

    def test_collectives_keep_types(self) -> None:
        results = self._run(_collectives, self.config())
        world = self.world_size
        for r in results:
            assert r["world"] == world
            assert r["mean"] == sum(range(world)) / world and isinstance(r["mean"], float)
            assert r["sum_int"] == sum(range(1, world + 1)) and isinstance(r["sum_int"], int)
            assert r["max_tensor"].tolist() == [world - 1, 0]
            assert r["dict"]["a"] == 1.0 and r["dict"]["b"].tolist() == [1.0, 1.0]
            assert r["gather"].shape == (world, 2) and r["gather_num"] == list(range(world))

    def test_checkpoint_layout_rotation_and_missing_checkpoint(self, tmp_path: Path) -> None:
        per_rank = self._run(_rotation, self.config(), str(tmp_path))
        errors = [message for messages in per_rank for message in messages]
        kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
        assert kept == ["b", "c"], kept
        assert (tmp_path / "latest").read_text().strip() == "c"
        metadata = json.loads((tmp_path / "c" / "lightrft_checkpoint.json").read_text())
        assert metadata["world_size"] == self.world_size
        assert len(errors) == self.world_size, "load_ckpt of a missing directory did not raise"
        assert all("nothing-here" in e for e in errors), errors

    def test_dataloader_is_deterministic_disjoint_and_resumable(self) -> None:
        results = self._run(_loaders, self.config())
        for r in results:
            assert r["order"] == r["again"], "the same seed gave another order"
            assert r["resumed"] == r["order"][3:], "consumed_samples did not resume"
        # an epoch over all ranks: every sample once, bar the tail drop_last drops (none
        # when 2 x world size divides 24: then each index of the dataset comes exactly once)
        every = sorted(i for r in results for batch in r["order"] for i in batch)
        per_rank = 24 // self.world_size // 2 * 2
        assert len(every) == per_rank * self.world_size, every
        assert len(set(every)) == len(every), f"a sample came twice in one epoch: {every}"
        if 24 % (2 * self.world_size) == 0:
            assert every == list(range(24)), every

    def test_truncated_or_foreign_checkpoints_are_refused(self, tmp_path: Path) -> None:
        cfg = self.config()
        self._run(_train, cfg, 1, save_dir=str(tmp_path))
        tag = tmp_path / "global_step1"
        metadata_file = tag / "lightrft_checkpoint.json"
        metadata = json.loads(metadata_file.read_text())
        # another backend's checkpoint: named, nothing loaded
        metadata_file.write_text(json.dumps({**metadata, "backend": "someone-else"}))
        for error, unchanged in self._run(_load_error, cfg, str(tmp_path)):
            assert error.startswith("ForeignCheckpointError"), error
            assert "someone-else" in error, error
            assert unchanged, "a refused checkpoint changed the model's weights"
        metadata_file.write_text(json.dumps(metadata))
        # a file cut short: named, nothing loaded
        victim = max((p for p in tag.rglob("*") if p.is_file() and p != metadata_file),
                     key=lambda p: p.stat().st_size)  # fmt: skip
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        for error, unchanged in self._run(_load_error, cfg, str(tmp_path)):
            assert error.startswith("IncompleteCheckpointError"), error
            assert victim.name in error, error
            assert unchanged, "a refused checkpoint changed the model's weights"

    def test_engine_weight_sync_and_generation(self) -> None:
        results = self._run(_engine, self.config())
        assert results[0]["record"] == results[0]["full"], "the engine got other weights"
        for r in results:
            assert r["returned"] == r["prompts"], "a rank got outputs that are not its own"
