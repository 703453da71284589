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

    python benchmarks/fsdp2_overhead.py [--steps 10] [--rounds 7] [--dim 256] [--layers 4]

re-launches itself under torchrun with 2 processes (OMP_NUM_THREADS=1); or launch it
yourself:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/fsdp2_overhead.py
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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
from torch.distributed.tensor import DTensor

from lightrft.strategy import get_strategy
from lightrft.strategy.fsdp2 import FSDP2Strategy

TARGET_PERCENT = 3.0
#: Functions --profile lists by cumulative time (a regular expression on file:line(name)).
PROFILE_FILTER = (
    "lightrft|fsdp2_overhead|clip_grad|optimizer.py|wait|all_gather_single|reduce_scatter"
    "|all_reduce|run_backward"
)


# -- the model ---------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: self-attention, then a 4x MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        # (tokens, dim): a 2-D matmul, so the root's output is not a view of another tensor
        return self.head(self.norm(x).flatten(0, 1))


def build_model(args: argparse.Namespace) -> TinyTransformer:
    torch.manual_seed(args.seed)
    return TinyTransformer(args.dim, args.layers, args.heads)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The strategy's split (weights decayed; biases and norms not)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class Batches:
    """A fixed pool of this rank's micro-batches, cycled; each side gets its own cursor."""

    def __init__(self, args: argparse.Namespace, rank: int, pool: int = 8) -> None:
        gen = torch.Generator().manual_seed(args.seed + 1 + rank)
        shape = (args.micro_batch, args.seq, args.dim)
        self.data = [
            (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen).flatten(0, 1))
            for _ in range(pool)
        ]
        self.cursor = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.data[self.cursor % len(self.data)]
        self.cursor += 1
        return batch


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


# -- timing ------------------------------------------------------------------------------
def timed(fn: Callable[[], None], repeat: int = 1) -> float:
    """Seconds for ``repeat`` calls of ``fn`` on every rank (barriers on both sides)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    dist.barrier()
    return time.perf_counter() - start


def interleaved(
    sides: list[Any], run: Callable[[Any], float], rounds: int, label: str, rank: int
) -> dict[str, list[float]]:
    """``run(side)`` for each side, ``rounds`` times, alternating which side goes first."""
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            times[side.name].append(run(side))
        if rank == 0:
            print(f"\r  {label}: round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    if rank == 0:
        print(file=sys.stderr)
    return times


def machine_busy_seconds() -> float | None:
    """CPU-seconds every process on this machine has spent busy (or stolen by the
    hypervisor) since boot, from /proc/stat; None where there is no /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def other_processes_cpus(wall0: float, own0: float, busy0: float | None) -> float | None:
    """CPUs that processes other than this job's ranks kept busy, on average, since the
    start figures (all ranks call it; the answer is meaningful on rank 0, single node)."""
    own = torch.tensor(time.process_time() - own0, dtype=torch.float64)
    dist.all_reduce(own)
    busy1 = machine_busy_seconds()
    wall = time.perf_counter() - wall0
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, (busy1 - busy0 - float(own)) / wall)


def max_param_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest |a - b| over all parameters, over all ranks' shards."""
    worst = torch.zeros(())
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        la = pa.to_local() if isinstance(pa, DTensor) else pa
        lb = pb.to_local() if isinstance(pb, DTensor) else pb
        if la.numel():
            worst = torch.maximum(worst, (la.detach() - lb.detach()).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def profile_steps(side: Any, steps: int, top: int) -> str:
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(steps):
        side.step()
    profiler.disable()
    dist.barrier()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    print("-- by own time:", file=out)
    stats.sort_stats("tottime").print_stats(top)
    print("-- by cumulative time, the training calls and collectives only:", file=out)
    stats.sort_stats("cumulative").print_stats(PROFILE_FILTER, top)
    return out.getvalue()


def report_pair(
    title: str, raw: list[float], ours: list[float], unit: str, scale: float
) -> tuple[float, float]:
    r, o = statistics.median(raw), statistics.median(ours)
    print(title)
    print(f"  raw                    {r * scale:9.2f} {unit}")
    print(f"  strategy               {o * scale:9.2f} {unit}")
    ratios = [b / a for a, b in zip(raw, ours, strict=True)]
    print(f"  ratio strategy/raw     {o / r:9.3f}x")
    print(
        f"  per-round ratios       median {statistics.median(ratios):.3f}x, "
        f"range {min(ratios):.3f}x .. {max(ratios):.3f}x"
    )
    best_r, best_o = min(raw), min(ours)
    print(
        f"  best round             raw {best_r * scale:.2f}, strategy {best_o * scale:.2f} "
        f"{unit} (ratio {best_o / best_r:.3f}x)"
    )
    return r, o


# -- entry points ------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side per round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--ckpt-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--raw-reshard-root",
        action="store_true",
        help="raw side: reshard the root after forward too, as the strategy does "
        "(torch's default keeps it gathered, saving one all-gather per micro-batch)",
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes when re-launching under torchrun"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also cProfile STEPS steps of each side on rank 0 and print the top functions",
    )
    return parser.parse_args()


def relaunch(args: argparse.Namespace) -> int:
    """Run this script under torchrun with ``--nproc`` processes; its exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(Path(__file__).resolve()),
        *sys.argv[1:],
    ]
    return subprocess.run(command, env=env, check=False).returncode


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        sys.exit(relaunch(args))

    # The strategy logs "saved/loaded checkpoint" on rank 0; keep it out of the figures.
    quiet = logging.getLogger("lightrft.strategy.print")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False

    world = int(os.environ["WORLD_SIZE"])
    strategy = get_strategy(
        {
            "backend": "fsdp2",
            "device": "cpu",
            "bf16": False,
            "seed": args.seed,
            "train_batch_size": args.micro_batch * world * args.accum,
            "micro_train_batch_size": args.micro_batch,
            "max_norm": args.max_norm,
            "actor_learning_rate": args.lr,
            "adam_betas": (0.9, 0.95),
            "l2": args.weight_decay,
            "lr_warmup_ratio": 0.0,
            "lr_scheduler": "constant_with_warmup",
        }
    )
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
    run_start = (time.perf_counter(), time.process_time(), machine_busy_seconds())
    cpu: dict[str, list[float]] = {side.name: [] for side in sides}

    def train(side: Any) -> float:
        start = time.process_time()
        wall = timed(side.step, args.steps)
        cpu[side.name].append(time.process_time() - start)
        return wall

    steps = interleaved(sides, train, args.rounds, "training", rank)
    difference = max_param_difference(raw.model, ours.model)

    if args.profile:
        reports = {side.name: profile_steps(side, args.profile, 25) for side in sides}

    ckpt_rounds = args.ckpt_rounds or args.rounds
    root_box: list[Any] = [tempfile.mkdtemp(prefix="fsdp2_overhead_") if rank == 0 else None]
    dist.broadcast_object_list(root_box, src=0)
    root = Path(root_box[0])
    save_counts = {side.name: 0 for side in sides}
    load_counts = {side.name: 0 for side in sides}

    def save(side: Any) -> float:
        index = save_counts[side.name]
        save_counts[side.name] += 1
        return timed(lambda: side.save(root, index))

    def load(side: Any) -> float:
        index = load_counts[side.name]
        load_counts[side.name] += 1
        return timed(lambda: side.load(root, index))

    try:
        for side in sides:  # untimed: first saves and loads pay one-off costs
            side.save(root / "warmup", 0)
            side.load(root / "warmup", 0)
        save_times = interleaved(sides, save, ckpt_rounds, "checkpoint save", rank)
        load_times = interleaved(sides, load, ckpt_rounds, "checkpoint load", rank)
        others = other_processes_cpus(*run_start)
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    if rank == 0:
        if others is not None:
            print(
                f"other processes kept {others:.2f} of {os.cpu_count()} CPUs busy on average "
                "during the run" + (": the figures are noisy" if others > 0.25 else "")
            )
        r, o = report_pair(
            f"training step, median over {args.rounds} rounds:",
            steps[raw.name],
            steps[ours.name],
            "ms/step",
            1e3 / args.steps,
        )
        overhead = (o / r - 1) * 100
        print(f"  steps/s raw            {args.steps / r:9.2f}")
        print(f"  steps/s strategy       {args.steps / o:9.2f}")
        verdict = "met" if overhead < TARGET_PERCENT else "NOT met"
        print(
            f"  strategy overhead      {overhead:+9.2f} %   (target < {TARGET_PERCENT:g}%: "
            f"{verdict})"
        )
        cpu_r, cpu_o = statistics.median(cpu[raw.name]), statistics.median(cpu[ours.name])
        print(
            f"  rank-0 CPU time/step   raw {cpu_r * 1e3 / args.steps:.2f}, strategy "
            f"{cpu_o * 1e3 / args.steps:.2f} ms ({(cpu_o / cpu_r - 1) * 100:+.2f} %)"
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
