"""Benchmark DeepspeedStrategy against a hand-written DeepSpeed loop doing the same work,
and DeepSpeed against FSDP2 through the strategy.

Every side trains the same small transformer-like model (same seed, same data; the
model of ``fsdp2_overhead.py``): fp32, AdamW, gradient accumulation, global-norm
clipping, a LambdaLR schedule. Measures, interleaved over rounds (alternating which side
goes first):
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
N steps per raw/strategy side (rank 0).

    python benchmarks/deepspeed_overhead.py [--steps 10] [--rounds 5] [--stages 2,3]

re-launches itself under torchrun with 2 processes (OMP_NUM_THREADS=1,
DS_ACCELERATOR=cpu); or launch it yourself:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/deepspeed_overhead.py
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import importlib
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
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightrft.strategy import get_strategy

TARGET_PERCENT = 3.0
#: Functions --profile lists by cumulative time (a regular expression on file:line(name)).
PROFILE_FILTER = (
    "lightrft|deepspeed_overhead|engine.py|stage_1_and_2|stage3|clip|optimizer.py|wait"
    "|all_gather|reduce_scatter|all_reduce|run_backward"
)


# -- the model (as in fsdp2_overhead.py) -------------------------------------------------
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
        out: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return out


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
        out: torch.Tensor = self.head(self.norm(x).flatten(0, 1))
        return out


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


def strategy_config(args: argparse.Namespace, world: int, **changes: Any) -> dict[str, Any]:
    return {
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
        **changes,
    }


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


def local_parameters(model: nn.Module) -> Iterator[torch.Tensor]:
    """This rank's part of each parameter: the ZeRO-3 partition, the DTensor shard, or
    the whole (replicated) tensor."""
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            yield param.ds_tensor.detach()
        elif isinstance(param, DTensor):
            yield param.to_local().detach()
        else:
            yield param.detach()


def max_param_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest |a - b| over all parameters, over all ranks' parts."""
    worst = torch.zeros(())
    for la, lb in zip(local_parameters(a), local_parameters(b), strict=True):
        if la.numel():
            worst = torch.maximum(worst, (la - lb).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def wrapper_costs(stats: pstats.Stats) -> list[str]:
    """For each training call of the strategy (``backward``, ``optimizer_step``): the time
    it took less the time of the ``engine.backward`` / ``engine.step`` made from it, per
    call (the engine's other small calls it makes count as the strategy's)."""
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
    return lines


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
    wrappers = wrapper_costs(stats)
    if wrappers:
        print("-- the strategy's own cost (its call's time less the engine call in it):", file=out)
        for line in wrappers:
            print(line, file=out)
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

    def train(side: Any) -> float:
        start = time.process_time()
        wall = timed(side.step, args.steps)
        cpu[side.name].append(time.process_time() - start)
        return wall

    steps = interleaved(sides, train, args.rounds, f"ZeRO-{stage} training", rank)
    difference = max_param_difference(raw.model, ours.model)
    profiles = (
        [(side.name, profile_steps(side, args.profile, 25)) for side in sides]
        if args.profile
        else []
    )

    save_times: dict[str, list[float]] = {}
    load_times: dict[str, list[float]] = {}
    if args.ckpt_rounds:
        stage_root = root / f"zero{stage}"
        save_counts = {side.name: 0 for side in sides}
        load_counts = {side.name: 0 for side in sides}

        def save(side: Any) -> float:
            index = save_counts[side.name]
            save_counts[side.name] += 1
            return timed(lambda: side.save(stage_root, index))

        def load(side: Any) -> float:
            index = load_counts[side.name]
            load_counts[side.name] += 1
            return timed(lambda: side.load(stage_root, index))

        for side in sides:  # untimed: first saves and loads pay one-off costs
            side.save(stage_root / "warmup", 0)
            side.load(stage_root / "warmup", 0)
        save_times = interleaved(sides, save, args.ckpt_rounds, f"ZeRO-{stage} save", rank)
        load_times = interleaved(sides, load, args.ckpt_rounds, f"ZeRO-{stage} load", rank)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(stage_root, ignore_errors=True)

    raw.close()
    del raw, sides
    gc.collect()

    def report() -> None:
        r, o = report_pair(
            f"ZeRO-{stage} training step, median over {args.rounds} rounds:",
            steps[f"raw ZeRO-{stage}"],
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
        cpu_r = statistics.median(cpu[f"raw ZeRO-{stage}"])
        cpu_o = statistics.median(cpu[ours.name])
        print(
            f"  rank-0 CPU time/step   raw {cpu_r * 1e3 / args.steps:.2f}, strategy "
            f"{cpu_o * 1e3 / args.steps:.2f} ms ({(cpu_o / cpu_r - 1) * 100:+.2f} %)"
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
        sides, lambda side: timed(side.step, args.steps), args.rounds, "FSDP2 vs DeepSpeed", rank
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
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument(
        "--ckpt-rounds", type=int, default=3, help="checkpoint save/load rounds (0: none)"
    )
    parser.add_argument(
        "--stages", default="2,3", help="ZeRO stages to measure, comma-separated (0-3)"
    )
    parser.add_argument(
        "--no-fsdp2", action="store_true", help="skip the FSDP2 vs DeepSpeed comparison"
    )
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
        "--nproc", type=int, default=2, help="processes when re-launching under torchrun"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also cProfile STEPS steps of each raw/strategy side on rank 0 and print the "
        "top functions",
    )
    args = parser.parse_args()
    try:
        args.stage_list = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--stages {args.stages!r}: expected comma-separated integers")
    if not args.stage_list or any(not 0 <= s <= 3 for s in args.stage_list):
        parser.error(f"--stages {args.stages!r}: stages lie in 0..3")
    return args


def relaunch(args: argparse.Namespace) -> int:
    """Run this script under torchrun with ``--nproc`` processes; its exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")  # what DeepSpeed detects here, without a warning
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

    # The strategy logs "saved/loaded checkpoint" on rank 0, DeepSpeed its INFO lines on
    # every initialize and checkpoint; keep them out of the figures.
    quiet = logging.getLogger("lightrft.strategy.print")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
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

    root_box: list[Any] = [tempfile.mkdtemp(prefix="ds_overhead_") if rank == 0 else None]
    dist.broadcast_object_list(root_box, src=0)
    root = Path(root_box[0])
    reports: list[Callable[[], None]] = []
    ours: list[StrategySide] = []
    dist.barrier()
    run_start = (time.perf_counter(), time.process_time(), machine_busy_seconds())
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
        if others is not None:
            print(
                f"other processes kept {others:.2f} of {os.cpu_count()} CPUs busy on average "
                "during the run" + (": the figures are noisy" if others > 0.25 else "")
            )
        for report in reports:
            report()

    # DeepSpeed's order: engines first, then the process group (owned by the first)
    for strategy in reversed(strategies):
        strategy.close()


if __name__ == "__main__":
    main()
