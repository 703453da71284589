"""Benchmark DeepspeedStrategy against a hand-written DeepSpeed loop doing the same work,
and DeepSpeed against FSDP2 through the strategy.

Every side trains the same small transformer-like model (same seed, same data; the
model of ``fsdp2_overhead.py``, from ``_common.py``): fp32, AdamW, gradient
accumulation, global-norm clipping, a LambdaLR schedule. Measures, interleaved over
rounds (alternating which side goes first):
  * for each ZeRO stage in ``--stages``: training steps/s of a raw loop
    (``deepspeed.initialize`` with a torch AdamW and LambdaLR, ``engine.backward`` /
    ``engine.step`` per micro-batch) vs ``strategy.backward`` /
    ``strategy.optimizer_step``, with the strategy's overhead in % (target < 3%). The
    raw engine gets the very DeepSpeed config the strategy builds
    (``strategy.get_ds_train_config()``), so both do the same DeepSpeed work; the final
    parameters of both are compared;
  * checkpoint save and load at each stage: raw ``engine.save_checkpoint`` /
    ``engine.load_checkpoint`` vs ``strategy.save_ckpt`` / ``strategy.load_ckpt``
    (which also write scheduler, RNG and metadata files, rename atomically and read
    DeepSpeed's files with ``weights_only=True``);
  * the step time of FSDP2Strategy vs DeepspeedStrategy at each stage (the strategy
    sides above), all through the strategy.
Every rank builds the same seeded model outside ``strategy.init_model_context()`` on
every side, so at ZeRO-3 ``deepspeed.initialize`` partitions it. It also prints how busy
other processes kept the CPUs meanwhile: on a shared 2-core machine that noise is larger
than the effect measured; read the per-round ranges. ``--profile N`` adds a cProfile of
N steps per raw/strategy side (rank 0). The model, data, timing, interleaving and
reporting are ``_common.py``'s (shared with ``fsdp2_overhead.py``); this script holds
the DeepSpeed sides and the per-stage and FSDP2 comparisons.

    python benchmarks/deepspeed_overhead.py [--steps 10] [--rounds 5] [--stages 2,3]

re-launches itself under torchrun with 2 processes (OMP_NUM_THREADS=1,
DS_ACCELERATOR=cpu); or launch it yourself:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/deepspeed_overhead.py
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import logging
import os
import pstats
import shutil
import statistics
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _common import (
    Batches,
    add_launch_arguments,
    add_model_arguments,
    add_round_arguments,
    build_model,
    interleaved,
    max_param_difference,
    other_processes_cpus,
    param_groups,
    profile_calls,
    quiet_logger,
    relaunch_under_torchrun,
    report_other_processes,
    report_overhead,
    report_pair,
    shared_tempdir,
    start_figures,
    strategy_config,
    time_checkpoints,
    timed,
    under_torchrun,
)
from lightrft.strategy import get_strategy

TARGET_PERCENT = 3.0
#: Functions --profile lists by cumulative time (a regular expression on file:line(name));
#: the model's forward is in _common.py.
PROFILE_FILTER = (
    "lightrft|deepspeed_overhead|engine.py|stage_1_and_2|stage3|clip|optimizer.py|wait"
    r"|all_gather|reduce_scatter|all_reduce|run_backward|[/\\]_common\.py"
)


# -- the sides ---------------------------------------------------------------------------
class RawDeepSpeed:
    """Hand-written DeepSpeed training: ``deepspeed.initialize`` with the strategy's
    config, then ``engine.backward`` / ``engine.step`` per micro-batch."""

    def __init__(
        self, args: argparse.Namespace, stage: int, ds_config: dict[str, Any], rank: int
    ) -> None:
        deepspeed = importlib.import_module("deepspeed")
        self.name = f"raw ZeRO-{stage}"
        model = build_model(args)
        optim = torch.optim.AdamW(
            param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95)
        )
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
        self.engine, self.optim, _, self.sched = deepspeed.initialize(
            model=model,
            optimizer=optim,
            lr_scheduler=sched,
            config=copy.deepcopy(ds_config),
            dist_init_required=False,
        )
        self.accum = args.accum
        self.batches = Batches(args, rank)

    @property
    def model(self) -> nn.Module:
        module: nn.Module = self.engine.module
        return module

    def step(self) -> None:
        for _ in range(self.accum):
            x, y = self.batches.next()
            loss = nn.functional.mse_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()

    def save(self, root: Path, index: int) -> None:
        self.engine.save_checkpoint(str(root / "raw"), tag=f"r{index}")

    def load(self, root: Path, index: int) -> None:
        path, _ = self.engine.load_checkpoint(str(root / "raw"), tag=f"r{index}")
        assert path is not None

    def close(self) -> None:
        self.engine.destroy()


class StrategySide:
    """The same training through a strategy (DeepspeedStrategy or FSDP2Strategy)."""

    def __init__(self, args: argparse.Namespace, strategy: Any, name: str, rank: int) -> None:
        self.name = name
        self.strategy = strategy
        (self.engine, self.optim, self.sched), *_ = strategy.prepare_models_and_optimizers(
            build_model(args), None, None, None, None, max_steps=100_000
        )
        self.batches = Batches(args, rank)

    @property
    def model(self) -> nn.Module:
        module: nn.Module = self.strategy.unwrap_model(self.engine)
        return module

    def step(self) -> None:
        for _ in range(self.strategy.accumulated_gradient):
            x, y = self.batches.next()
            loss = nn.functional.mse_loss(self.engine(x), y)
            self.strategy.backward(loss, self.engine, self.optim)
            self.strategy.optimizer_step(self.optim, self.engine, self.sched)

    def save(self, root: Path, index: int) -> None:
        self.strategy.save_ckpt(self.engine, root / "strategy", tag=f"r{index}", max_num=100_000)

    def load(self, root: Path, index: int) -> None:
        self.strategy.load_ckpt(self.engine, root / "strategy", tag=f"r{index}")


# -- profiling ---------------------------------------------------------------------------
def wrapper_costs(stats: pstats.Stats) -> list[str]:
    """For each training call of the strategy (``backward``, ``optimizer_step``): the time
    it took less the time of the ``engine.backward`` / ``engine.step`` made from it, per
    call (the engine's other small calls it makes count as the strategy's); under a
    heading, or no lines where the profile has no such call (a raw side's)."""
    table: dict[Any, Any] = vars(stats)["stats"]
    lines = []
    for key, (_cc, calls, _own, total, _callers) in sorted(table.items()):
        path, _line, name = key
        if "lightrft/strategy/" not in path.replace(os.sep, "/") or name not in (
            "backward",
            "optimizer_step",
        ):
            continue
        # engine.backward shows as DeepSpeed's NVTX wrapper (deepspeed/utils/nvtx.py)
        inner = sum(
            callers[key][3]
            for (callee_path, _, callee), (*_, callers) in table.items()
            if key in callers
            and callee in ("backward", "step", "wrapped_fn")
            and "/deepspeed/" in callee_path.replace(os.sep, "/")
            and "lightrft" not in callee_path
        )
        lines.append(
            f"  {name:<15} {(total - inner) / calls * 1e3:8.3f} ms per call over "
            f"{inner / calls * 1e3:8.3f} ms in the engine call ({calls} calls)"
        )
    if not lines:
        return []
    return ["-- the strategy's own cost (its call's time less the engine call in it):", *lines]


def profile_steps(side: Any, steps: int) -> str:
    """A cProfile of ``steps`` steps of ``side``, the strategy's own cost first."""
    return profile_calls(side.step, steps, 25, PROFILE_FILTER, summary=wrapper_costs)


# -- the measurements --------------------------------------------------------------------
def measure_stage(
    args: argparse.Namespace, stage: int, strategy: Any, rank: int, root: Path
) -> tuple[StrategySide, Callable[[], None]]:
    """Raw loop vs DeepspeedStrategy at ``stage``: training, then checkpoints. Returns
    the strategy side (kept for the FSDP2 comparison; the raw engine is destroyed) and
    the function that prints the figures (on rank 0, at the end)."""
    ds_config = strategy.get_ds_train_config()
    raw = RawDeepSpeed(args, stage, ds_config, rank)
    ours = StrategySide(args, strategy, f"DeepspeedStrategy ZeRO-{stage}", rank)
    sides: list[Any] = [raw, ours]
    for side in sides:
        timed(side.step, args.warmup)
    cpu: dict[str, list[float]] = {side.name: [] for side in sides}
    steps = interleaved(
        {side.name: partial(timed, side.step, args.steps, cpu[side.name]) for side in sides},
        args.rounds,
        f"ZeRO-{stage} training",
        progress=rank == 0,
    )
    difference = max_param_difference(raw.model, ours.model)
    profiles = (
        [(side.name, profile_steps(side, args.profile)) for side in sides] if args.profile else []
    )

    save_times: dict[str, list[float]] = {}
    load_times: dict[str, list[float]] = {}
    if args.ckpt_rounds:
        stage_root = root / f"zero{stage}"
        save_times, load_times = time_checkpoints(
            sides, stage_root, args.ckpt_rounds, f"ZeRO-{stage}", progress=rank == 0
        )
        dist.barrier()
        if rank == 0:
            shutil.rmtree(stage_root, ignore_errors=True)

    raw.close()
    del raw, sides
    gc.collect()

    def report() -> None:
        report_overhead(
            f"ZeRO-{stage} training step, median over {args.rounds} rounds:",
            steps[f"raw ZeRO-{stage}"],
            steps[ours.name],
            cpu[f"raw ZeRO-{stage}"],
            cpu[ours.name],
            args.steps,
            TARGET_PERCENT,
        )
        same = "identical" if difference == 0 else "NOT identical"
        print(f"  same math: largest parameter difference after training {difference:.3g} ({same})")
        if save_times:
            report_pair(
                f"ZeRO-{stage} checkpoint save (model + AdamW state), median over "
                f"{args.ckpt_rounds} rounds:",
                save_times[f"raw ZeRO-{stage}"],
                save_times[ours.name],
                "ms",
                1e3,
            )
            report_pair(
                f"ZeRO-{stage} checkpoint load, median over {args.ckpt_rounds} rounds:",
                load_times[f"raw ZeRO-{stage}"],
                load_times[ours.name],
                "ms",
                1e3,
            )
        for name, text in profiles:
            print(f"cProfile of {args.profile} steps, {name} (rank 0)")
            print(text)

    return ours, report


def compare_backends(
    args: argparse.Namespace, fsdp2: StrategySide, deepspeed_sides: list[StrategySide], rank: int
) -> Callable[[], None]:
    """FSDP2Strategy vs DeepspeedStrategy (each stage), all through the strategy."""
    sides: list[Any] = [fsdp2, *deepspeed_sides]
    timed(fsdp2.step, args.warmup)
    steps = interleaved(
        {side.name: partial(timed, side.step, args.steps) for side in sides},
        args.rounds,
        "FSDP2 vs DeepSpeed",
        progress=rank == 0,
    )
    scale = 1e3 / args.steps

    def report() -> None:
        print(f"FSDP2 vs DeepSpeed through the strategy, median over {args.rounds} rounds:")
        base = statistics.median(steps[fsdp2.name])
        for side in sides:
            ms = statistics.median(steps[side.name])
            print(f"  {side.name:<26} {ms * scale:9.2f} ms/step  {args.steps / ms:7.2f} steps/s")
        for side in deepspeed_sides:
            ms = statistics.median(steps[side.name])
            ratios = [b / a for a, b in zip(steps[fsdp2.name], steps[side.name], strict=True)]
            print(
                f"  {side.name.removeprefix('DeepspeedStrategy ')} / FSDP2{'':<11} "
                f"{ms / base:9.3f}x  (per-round median {statistics.median(ratios):.3f}x, "
                f"range {min(ratios):.3f}x .. {max(ratios):.3f}x)"
            )

    return report


# -- entry points ------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_round_arguments(parser, rounds=5)
    parser.add_argument(
        "--ckpt-rounds", type=int, default=3, help="checkpoint save/load rounds (0: none)"
    )
    parser.add_argument(
        "--stages", default="2,3", help="ZeRO stages to measure, comma-separated (0-3)"
    )
    parser.add_argument(
        "--no-fsdp2", action="store_true", help="skip the FSDP2 vs DeepSpeed comparison"
    )
    add_model_arguments(parser)
    add_launch_arguments(parser, profiled="each raw/strategy side")
    args = parser.parse_args()
    try:
        args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--stages {args.stages!r}: expected comma-separated integers")
    if not args.stage_list or any(not 0 <= s <= 3 for s in args.stage_list):
        parser.error(f"--stages {args.stages!r}: stages lie in 0..3")
    return args


def main() -> None:
    args = parse_args()
    if not under_torchrun():
        # DS_ACCELERATOR=cpu: what DeepSpeed detects here, without a warning
        sys.exit(relaunch_under_torchrun(__file__, args.nproc, {"DS_ACCELERATOR": "cpu"}))

    # The strategy logs "saved/loaded checkpoint" on rank 0, DeepSpeed its INFO lines on
    # every initialize and checkpoint; keep them out of the figures.
    quiet_logger("lightrft.strategy.print")
    importlib.import_module("deepspeed")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's communication layer calls torch's deprecated collective names
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )

    world = int(os.environ["WORLD_SIZE"])
    strategies: list[Any] = []
    for stage in args.stage_list:
        strategy = get_strategy(strategy_config(args, world, backend="deepspeed", zero_stage=stage))
        # Built ready: the first creates the gloo group (and DeepSpeed's communication
        # layer wraps it); the others join it. The raw engines use it too.
        assert strategy.accumulated_gradient == args.accum
        strategies.append(strategy)
    rank = dist.get_rank()

    n_params = sum(p.numel() for p in build_model(args).parameters())
    if rank == 0:
        ds_version = importlib.import_module("deepspeed").__version__
        print(
            f"DeepSpeed {ds_version} on CPU/gloo, {world} processes x "
            f"{torch.get_num_threads()} threads; model {args.layers} blocks x dim {args.dim} "
            f"({n_params / 1e6:.2f} M params, fp32), micro-batch {args.micro_batch} x seq "
            f"{args.seq}, {args.accum} micro-batches per step"
        )
        print(
            f"training: {args.rounds} interleaved rounds x {args.steps} steps per side "
            f"(after {args.warmup} warmup steps each); ZeRO stages {args.stages}"
        )
        for stage, strategy in zip(args.stage_list, strategies, strict=True):
            cfg = strategy.get_ds_train_config()
            print(
                f"ZeRO-{stage} config (both sides): gradient_accumulation_steps "
                f"{cfg['gradient_accumulation_steps']}, gradient_clipping "
                f"{cfg['gradient_clipping']}, zero_optimization {cfg['zero_optimization']}"
            )

    root = shared_tempdir("ds_overhead_")
    reports: list[Callable[[], None]] = []
    ours: list[StrategySide] = []
    dist.barrier()
    run_start = start_figures()
    try:
        for stage, strategy in zip(args.stage_list, strategies, strict=True):
            side, report = measure_stage(args, stage, strategy, rank, root)
            ours.append(side)
            reports.append(report)
        if not args.no_fsdp2:
            fsdp2_strategy = get_strategy(strategy_config(args, world, backend="fsdp2"))
            strategies.append(fsdp2_strategy)
            fsdp2 = StrategySide(args, fsdp2_strategy, "FSDP2Strategy", rank)
            reports.append(compare_backends(args, fsdp2, ours, rank))
        others = other_processes_cpus(*run_start)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    if rank == 0:
        report_other_processes(others)
        for report in reports:
            report()

    # DeepSpeed's order: engines first, then the process group (owned by the first)
    for strategy in reversed(strategies):
        strategy.close()


if __name__ == "__main__":
    main()
