"""What the benchmarks in this folder share, so that each script keeps only its backend's
sides (the raw loop, the strategy) and what it measures.

Sections:
  * the model and data: the small transformer-like model every side trains
    (``build_model``), the strategy's parameter groups, each rank's micro-batches, the
    training options they read (``add_model_arguments``), the strategy config those
    options make, and the largest parameter difference between two trained models;
  * timing, interleaving, busy-machine sampling and reporting: generic helpers on plain
    callables and lists of seconds, with no model or argparse in them (``timed``,
    ``interleaved``, ``time_checkpoints``, ``profile_calls``, ``start_figures`` /
    ``other_processes_cpus``, ``report_pair`` / ``report_overhead``); they barrier and
    reduce over all ranks where torch.distributed is initialized, and work in one plain
    process too;
  * launching and the run's setup: the common ``--steps/--rounds/--warmup`` and
    ``--nproc/--profile`` options, re-launching a script under torchrun, quieting a
    logger, a temporary folder every rank knows.

The scripts import it as ``_common``: run as ``python benchmarks/X.py`` or under
``python -m torch.distributed.run ... benchmarks/X.py``, ``sys.path[0]`` is this folder.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# -- the model and data ------------------------------------------------------------------
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's and training's options, which the rest of this section reads."""
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


def build_model(args: argparse.Namespace) -> TinyTransformer:
    """The model of ``add_model_arguments``'s options, the same on every rank and side."""
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


def strategy_config(args: argparse.Namespace, world: int, **changes: Any) -> dict[str, Any]:
    """The strategy config of ``add_model_arguments``'s options on CPU, fp32, with a
    constant learning rate (a raw side's LambdaLR of 1.0), updated by ``changes``
    (``backend=...`` and the like)."""
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
    if _distributed():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


# -- timing, interleaving, busy-machine sampling and reporting ---------------------------
def timed(fn: Callable[[], None], repeat: int = 1, cpu: list[float] | None = None) -> float:
    """Seconds for ``repeat`` calls of ``fn`` on every rank (barriers on both sides where
    torch.distributed is initialized). Where ``cpu`` is given, this process's CPU seconds
    over the same span, barriers included, are appended to it."""
    cpu_start = time.process_time()
    _barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _barrier()
    wall = time.perf_counter() - start
    if cpu is not None:
        cpu.append(time.process_time() - cpu_start)
    return wall


def interleaved(
    runs: Mapping[str, Callable[[], float]], rounds: int, label: str, *, progress: bool
) -> dict[str, list[float]]:
    """Each of ``runs`` once per round, ``rounds`` times, alternating which goes first (the
    mapping's order, then the reverse): the figures each returned (seconds), by name.
    ``progress``: count the rounds on stderr (say so on one rank only)."""
    order = list(runs.items())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in order if r % 2 == 0 else order[::-1]:
            times[name].append(run())
        if progress:
            print(f"\r  {label}: round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return times


class Checkpointing(Protocol):
    """What ``time_checkpoints`` times: a named side that saves its ``index``-th
    checkpoint under ``root`` and loads it back."""

    @property
    def name(self) -> str: ...

    def save(self, root: Path, index: int) -> None: ...

    def load(self, root: Path, index: int) -> None: ...


def time_checkpoints(
    sides: Sequence[Checkpointing], root: Path, rounds: int, label: str, *, progress: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of each side's saves, then of its loads (``rounds`` each, interleaved as
    ``interleaved`` does, labelled "``label`` save" / "``label`` load"), after an untimed
    save and load under ``root / "warmup"`` (first saves and loads pay one-off costs).
    The i-th timed load reads the i-th timed save."""

    def each(call: Callable[[Path, int], None]) -> Callable[[], float]:
        counter = itertools.count()

        def run() -> float:
            index = next(counter)
            return timed(lambda: call(root, index))

        return run

    for side in sides:
        side.save(root / "warmup", 0)
        side.load(root / "warmup", 0)
    saves = interleaved(
        {side.name: each(side.save) for side in sides},
        rounds,
        f"{label} save",
        progress=progress,
    )
    loads = interleaved(
        {side.name: each(side.load) for side in sides},
        rounds,
        f"{label} load",
        progress=progress,
    )
    return saves, loads


def profile_calls(
    fn: Callable[[], None],
    repeat: int,
    top: int,
    cumulative_filter: str,
    *,
    cumulative_label: str = "the training calls and collectives only",
    summary: Callable[[pstats.Stats], list[str]] | None = None,
) -> str:
    """A cProfile of ``repeat`` calls of ``fn`` (between barriers), as text: the lines of
    ``summary(stats)`` where given, then the ``top`` functions by own time, then by
    cumulative time those whose file:line(name) matches ``cumulative_filter`` (a regular
    expression)."""
    profiler = cProfile.Profile()
    _barrier()
    profiler.enable()
    for _ in range(repeat):
        fn()
    profiler.disable()
    _barrier()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for line in summary(stats) if summary else []:
        print(line, file=out)
    print("-- by own time:", file=out)
    stats.sort_stats("tottime").print_stats(top)
    print(f"-- by cumulative time, {cumulative_label}:", file=out)
    stats.sort_stats("cumulative").print_stats(cumulative_filter, top)
    return out.getvalue()


def machine_busy_seconds() -> float | None:
    """CPU-seconds every process on this machine has spent busy (or stolen by the
    hypervisor) since boot, from /proc/stat; None where there is no /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def start_figures() -> tuple[float, float, float | None]:
    """What ``other_processes_cpus`` counts from: wall clock, this process's CPU time and
    the machine's busy seconds, now."""
    return time.perf_counter(), time.process_time(), machine_busy_seconds()


def other_processes_cpus(wall0: float, own0: float, busy0: float | None) -> float | None:
    """CPUs that processes other than this job's ranks kept busy, on average, since the
    start figures (all ranks call it; the answer is meaningful on rank 0, single node)."""
    own = torch.tensor(time.process_time() - own0, dtype=torch.float64)
    if _distributed():
        dist.all_reduce(own)
    busy1 = machine_busy_seconds()
    wall = time.perf_counter() - wall0
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, (busy1 - busy0 - float(own)) / wall)


def report_other_processes(others: float | None) -> None:
    """Print what ``other_processes_cpus`` found, if anything."""
    if others is not None:
        print(
            f"other processes kept {others:.2f} of {os.cpu_count()} CPUs busy on average "
            "during the run" + (": the figures are noisy" if others > 0.25 else "")
        )


def report_pair(
    title: str,
    raw: list[float],
    ours: list[float],
    unit: str,
    scale: float,
    *,
    names: tuple[str, str] = ("raw", "strategy"),
) -> tuple[float, float]:
    """Print two sides' per-round figures (``raw`` the baseline, ``ours`` the one
    measured against it; ``scale`` turns them into ``unit``): medians, their ratio, the
    per-round ratios and the best rounds. Returns the two medians, unscaled."""
    base, other = names
    r, o = statistics.median(raw), statistics.median(ours)
    print(title)
    print(f"  {base:<23}{r * scale:9.2f} {unit}")
    print(f"  {other:<23}{o * scale:9.2f} {unit}")
    ratios = [b / a for a, b in zip(raw, ours, strict=True)]
    print(f"  {f'ratio {other}/{base}':<23}{o / r:9.3f}x")
    print(
        f"  per-round ratios       median {statistics.median(ratios):.3f}x, "
        f"range {min(ratios):.3f}x .. {max(ratios):.3f}x"
    )
    best_r, best_o = min(raw), min(ours)
    print(
        f"  best round             {base} {best_r * scale:.2f}, {other} {best_o * scale:.2f} "
        f"{unit} (ratio {best_o / best_r:.3f}x)"
    )
    return r, o


def report_overhead(
    title: str,
    raw: list[float],
    ours: list[float],
    raw_cpu: list[float],
    ours_cpu: list[float],
    repeat: int,
    target_percent: float,
    *,
    names: tuple[str, str] = ("raw", "strategy"),
    per: str = "step",
) -> None:
    """``report_pair`` of per-round seconds for ``repeat`` calls (of ``per``: a step),
    then the rates, ``ours``'s overhead against ``target_percent`` and the CPU time per
    call of this process (``raw_cpu`` / ``ours_cpu``, per round; rank 0 prints)."""
    base, other = names
    r, o = report_pair(title, raw, ours, f"ms/{per}", 1e3 / repeat, names=names)
    overhead = (o / r - 1) * 100
    print(f"  {f'{per}s/s {base}':<23}{repeat / r:9.2f}")
    print(f"  {f'{per}s/s {other}':<23}{repeat / o:9.2f}")
    verdict = "met" if overhead < target_percent else "NOT met"
    print(
        f"  {f'{other} overhead':<23}{overhead:+9.2f} %   (target < {target_percent:g}%: {verdict})"
    )
    cpu_r, cpu_o = statistics.median(raw_cpu), statistics.median(ours_cpu)
    print(
        f"  {f'rank-0 CPU time/{per}':<23}{base} {cpu_r * 1e3 / repeat:.2f}, {other} "
        f"{cpu_o * 1e3 / repeat:.2f} ms ({(cpu_o / cpu_r - 1) * 100:+.2f} %)"
    )


# -- launching and the run's setup -------------------------------------------------------
def add_round_arguments(
    parser: argparse.ArgumentParser,
    *,
    rounds: int,
    steps_help: str = "optimizer steps per side per round",
    warmup_help: str = "untimed steps per side first",
) -> None:
    """``--steps``, ``--rounds`` (default ``rounds``) and ``--warmup``."""
    parser.add_argument("--steps", type=int, default=10, help=steps_help)
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help=warmup_help)


def add_launch_arguments(parser: argparse.ArgumentParser, *, profiled: str) -> None:
    """``--nproc`` (for ``relaunch_under_torchrun``) and ``--profile STEPS`` (of
    ``profiled``: "each side", say)."""
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes when re-launching under torchrun"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help=f"also cProfile STEPS steps of {profiled} on rank 0 and print the top functions",
    )


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's (or another launcher's that sets RANK)."""
    return "RANK" in os.environ


def relaunch_under_torchrun(
    script: str, nproc: int, env_defaults: Mapping[str, str] | None = None
) -> int:
    """Run ``script`` with this process's arguments under torchrun (standalone, ``nproc``
    processes; OMP_NUM_THREADS=1 and ``env_defaults`` where the environment does not set
    them); its exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(Path(script).resolve()),
        *sys.argv[1:],
    ]
    return subprocess.run(command, env=env, check=False).returncode


def quiet_logger(name: str) -> None:
    """Keep the records of logger ``name`` (say, the strategy's "saved checkpoint" lines)
    out of the figures."""
    logger = logging.getLogger(name)
    logger.addHandler(logging.NullHandler())
    logger.propagate = False


def shared_tempdir(prefix: str) -> Path:
    """A new temporary folder, made by rank 0 and named to every rank (single node);
    whoever calls it removes it."""
    first = not _distributed() or dist.get_rank() == 0
    box: list[Any] = [tempfile.mkdtemp(prefix=prefix) if first else None]
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    return Path(box[0])
