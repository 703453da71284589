"""Benchmark FSDP2Strategy against a hand-written FSDP2 loop doing the same work.

Both sides train the same small transformer-like model (same seed, same data): FSDP2
``fully_shard`` per block and at the root, fp32, AdamW, gradient accumulation with
gradient sync only on the last micro-step, global-norm clipping, a LambdaLR schedule.
Measures, interleaved over rounds (alternating which side goes first):
  * training steps/s, raw loop vs ``strategy.backward`` / ``strategy.optimizer_step``,
    with the strategy's overhead in % (target < 3%), and
  * checkpoint save and load: raw ``dcp.save`` / ``dcp.load`` of model + optimizer state
    vs ``strategy.save_ckpt`` / ``strategy.load_ckpt`` (which also write scheduler, RNG
    and metadata files and rename atomically).
It also prints how busy other processes kept the CPUs meanwhile: on a shared 2-core
machine that noise is larger than the effect measured; read the per-round ranges.
``--raw-reshard-root`` makes the raw side reshard its root after forward as the strategy
does; ``--profile N`` adds a cProfile of N steps per side (rank 0).
The model, data, timing, interleaving and reporting are ``_common.py``'s (shared with
``deepspeed_overhead.py``); this script holds the two FSDP2 sides.

    python benchmarks/fsdp2_overhead.py [--steps 10] [--rounds 7] [--dim 256] [--layers 4]

re-launches itself under torchrun with 2 processes (OMP_NUM_THREADS=1); or launch it
yourself:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/fsdp2_overhead.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

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
from lightrft.strategy.fsdp2 import FSDP2Strategy

TARGET_PERCENT = 3.0
#: Functions --profile lists by cumulative time (a regular expression on file:line(name));
#: the model's forward is in _common.py.
PROFILE_FILTER = (
    "lightrft|fsdp2_overhead|clip_grad|optimizer.py|wait|all_gather_single|reduce_scatter"
    r"|all_reduce|run_backward|[/\\]_common\.py"
)


# -- the two sides -----------------------------------------------------------------------
class RawSide:
    """Hand-written FSDP2 training: what the strategy does, spelled out."""

    name = "raw FSDP2 loop"

    def __init__(self, args: argparse.Namespace, mesh: Any, rank: int) -> None:
        reshard_root = args.raw_reshard_root
        self.model = build_model(args)
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        # torch's default keeps the root's parameters gathered from forward to backward;
        # the strategy passes reshard_after_forward=True to the root as well.
        fully_shard(self.model, mesh=mesh, reshard_after_forward=True if reshard_root else None)
        self.fsdp: FSDPModule = self.model  # type: ignore[assignment]
        self.optim = torch.optim.AdamW(
            param_groups(self.model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda step: 1.0)
        self.accum = args.accum
        self.max_norm = args.max_norm
        self.batches = Batches(args, rank)

    def step(self) -> None:
        for micro in range(self.accum):
            self.fsdp.set_requires_gradient_sync(micro == self.accum - 1)
            x, y = self.batches.next()
            loss = nn.functional.mse_loss(self.model(x), y)
            (loss / self.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)

    def save(self, root: Path, index: int) -> None:
        state: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optim),
        }
        dcp.save(state, checkpoint_id=root / f"raw_{index}")

    def load(self, root: Path, index: int) -> None:
        state: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optim),
        }
        dcp.load(state, checkpoint_id=root / f"raw_{index}")
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optim, state["optim"])


class StrategySide:
    """The same training through FSDP2Strategy."""

    name = "FSDP2Strategy"

    def __init__(self, args: argparse.Namespace, strategy: Any, rank: int) -> None:
        self.strategy = strategy
        (self.model, self.optim, self.sched), *_ = strategy.prepare_models_and_optimizers(
            build_model(args), None, None, None, None, max_steps=100_000
        )
        self.batches = Batches(args, rank)

    def step(self) -> None:
        for _ in range(self.strategy.accumulated_gradient):
            x, y = self.batches.next()
            loss = nn.functional.mse_loss(self.model(x), y)
            self.strategy.backward(loss, self.model, self.optim)
            self.strategy.optimizer_step(self.optim, self.model, self.sched)

    def save(self, root: Path, index: int) -> None:
        self.strategy.save_ckpt(self.model, root / "strategy", tag=f"r{index}", max_num=100_000)

    def load(self, root: Path, index: int) -> None:
        self.strategy.load_ckpt(self.model, root / "strategy", tag=f"r{index}")


# -- entry points ------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_round_arguments(parser, rounds=7)
    parser.add_argument("--ckpt-rounds", type=int, default=None, help="default: --rounds")
    add_model_arguments(parser)
    parser.add_argument(
        "--raw-reshard-root",
        action="store_true",
        help="raw side: reshard the root after forward too, as the strategy does "
        "(torch's default keeps it gathered, saving one all-gather per micro-batch)",
    )
    add_launch_arguments(parser, profiled="each side")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not under_torchrun():
        sys.exit(relaunch_under_torchrun(__file__, args.nproc))

    # The strategy logs "saved/loaded checkpoint" on rank 0; keep it out of the figures.
    quiet_logger("lightrft.strategy.print")

    world = int(os.environ["WORLD_SIZE"])
    strategy = get_strategy(strategy_config(args, world, backend="fsdp2"))
    assert isinstance(strategy, FSDP2Strategy)  # built ready: its gloo group is the raw side's too
    rank = dist.get_rank()
    assert strategy.accumulated_gradient == args.accum

    raw = RawSide(args, strategy.mesh, rank)
    ours = StrategySide(args, strategy, rank)
    sides: list[Any] = [raw, ours]
    n_params = sum(p.numel() for p in raw.model.parameters())

    if rank == 0:
        print(
            f"FSDP2 on CPU/gloo, {world} processes x {torch.get_num_threads()} threads; model "
            f"{args.layers} blocks x dim {args.dim} ({n_params / 1e6:.2f} M params, fp32), "
            f"micro-batch {args.micro_batch} x seq {args.seq}, {args.accum} micro-batches per "
            "step"
        )
        print(
            f"training: {args.rounds} interleaved rounds x {args.steps} steps per side "
            f"(after {args.warmup} warmup steps each)"
        )

    for side in sides:
        timed(side.step, args.warmup)
    dist.barrier()
    run_start = start_figures()
    cpu: dict[str, list[float]] = {side.name: [] for side in sides}
    steps = interleaved(
        {side.name: partial(timed, side.step, args.steps, cpu[side.name]) for side in sides},
        args.rounds,
        "training",
        progress=rank == 0,
    )
    difference = max_param_difference(raw.model, ours.model)

    if args.profile:
        reports = {
            side.name: profile_calls(side.step, args.profile, 25, PROFILE_FILTER) for side in sides
        }

    ckpt_rounds = args.ckpt_rounds or args.rounds
    root = shared_tempdir("fsdp2_overhead_")
    try:
        save_times, load_times = time_checkpoints(
            sides, root, ckpt_rounds, "checkpoint", progress=rank == 0
        )
        others = other_processes_cpus(*run_start)
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    if rank == 0:
        report_other_processes(others)
        report_overhead(
            f"training step, median over {args.rounds} rounds:",
            steps[raw.name],
            steps[ours.name],
            cpu[raw.name],
            cpu[ours.name],
            args.steps,
            TARGET_PERCENT,
        )
        print(f"  same math: largest parameter difference after training {difference:.3g}")
        report_pair(
            f"checkpoint save (model + AdamW state), median over {ckpt_rounds} rounds:",
            save_times[raw.name],
            save_times[ours.name],
            "ms",
            1e3,
        )
        report_pair(
            f"checkpoint load, median over {ckpt_rounds} rounds:",
            load_times[raw.name],
            load_times[ours.name],
            "ms",
            1e3,
        )
        if args.profile:
            for name, text in reports.items():
                print(f"cProfile of {args.profile} steps, {name} (rank 0)")
                print(text)

    strategy.close()  # barrier, then destroys the process group it created


if __name__ == "__main__":
    main()
