"""Benchmark token-budget micro-batches against fixed padded ones, on the same samples.

Two ranks (gloo on CPU, fp32), FSDP2 by default (``--backend deepspeed --zero-stage N``
for DeepSpeed), train a transformers Qwen2ForCausalLM built from a config (random init,
the same seeded weights on every rank and side; 32.5 M parameters at the default sizes)
on one global batch of GRPO-like samples, ``--samples`` per rank, each rank its own:
a short prompt, a response whose length is drawn like an RL response's (log-normal
with mean ``--mean-len``, capped at 8x the mean as ``max_new_tokens`` would; stratified
over the global batch, so the longest is about 8x the mean at the default sizes
whatever the seed), and one advantage. Both sides train the very same samples the way
a trainer does: ``strategy.plan_micro_batches``, then per micro-batch ``build_batch``,
``token_logprobs``, ``plan.loss(-advantage * logp, batch)`` (token-mean),
``strategy.backward`` and ``strategy.optimizer_step``:

* **padded**: fixed micro-batches of ``--micro-batch`` consecutive samples, one
  right-padded row each (``packing_samples`` off);
* **packed**: samples packed into one row per micro-batch under a token budget
  (``packing_samples=True, max_tokens_per_gpu=--budget``; by default the largest
  padded micro-batch's token area, rows x width, over the ranks: what the padded side
  already needs room for), each sample attending within itself in one SDPA call
  (``packing.use_packed_attention``, as the demo runs them).

Each side has its own strategy (the second joins the first's process group) and model.
The first step of each side is a warm-up, and its full gradients (gathered from the
shards before the optimizer steps) are compared; then ``--steps`` rounds of one step
per side, alternating which goes first, are timed. Printed:

* the padded fraction of the fixed run: padding tokens over the tokens its forwards
  compute, summed over every micro-batch of a step on every rank;
* step time of each side: the median over the timed steps (seconds, barrier to barrier,
  so the slower rank's), the plan and the building of the batches included;
* peak memory per rank of each side: the largest resident set size during a step
  (``/proc/self/statm``, sampled every ``--sample-ms`` ms by a background thread) minus
  the RSS just before it, the largest over the timed steps; the ratio takes the rank
  that needs the most on each side. glibc keeps memory freed to its heap resident for
  reuse, so each step starts with ``malloc_trim(0)``, which hands it back: the figure
  is what the step touches beyond the model, gradients and optimizer state it starts
  with (activations, logits, gathered parameters, unsharded gradients, the optimizer's
  temporaries), plus what the allocator keeps of memory freed within the step. It is
  the system's view, so the sides differ less than their activations do;
* the largest absolute difference between the two sides' first-step gradients (the
  same math split differently: only float rounding should tell them apart).

It also prints how busy other processes kept the CPUs meanwhile: on a shared 2-core
machine that noise is larger than some effects measured. The last line sums it up:

    dynamic_batch: padded <s> s, packed <s> s, speedup <x>x, peak memory <ratio>x, grad max diff <d>

(speedup: padded / packed step time; peak memory: packed / padded). Run

    python benchmarks/dynamic_batch.py [--samples 32] [--mean-len 48] [--budget TOKENS]

which re-launches itself under torchrun with 2 processes (OMP_NUM_THREADS=1,
DS_ACCELERATOR=cpu); one run at the default sizes takes about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import logging
import math
import os
import statistics
import sys
import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from _common import (
    interleaved,
    other_processes_cpus,
    quiet_logger,
    relaunch_under_torchrun,
    report_other_processes,
    start_figures,
    strategy_config,
    timed,
    under_torchrun,
)
from lightrft.strategy import get_strategy
from lightrft.strategy.packing import Sample, build_batch, token_logprobs, use_packed_attention

#: Responses are capped at this many times the mean length (a rollout's max_new_tokens).
LENGTH_CAP = 8
#: What the re-launch sets, where the environment does not (see the module docstring).
ENV_DEFAULTS = {"DS_ACCELERATOR": "cpu"}


# -- the samples and the model -----------------------------------------------------------
def response_lengths(args: argparse.Namespace, world: int) -> list[int]:
    """Every rank's response lengths, ``--samples`` per rank (rank r's are the r-th
    slice): log-normal with mean ``--mean-len`` and spread ``--sigma``, at most
    ``LENGTH_CAP`` times the mean (a rollout's max_new_tokens). Stratified, so that the
    shape does not hang on the seed: the i-th of the n lengths is drawn from the i-th of
    n equally likely slices of the distribution, then they are shuffled (seeded)."""
    n = args.samples * world
    gen = torch.Generator().manual_seed(args.seed)
    quantiles = (
        torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=gen, dtype=torch.float64)
    ) / n
    mu = math.log(args.mean_len) - args.sigma**2 / 2  # so that the mean is --mean-len
    draws = torch.exp(mu + args.sigma * torch.special.ndtri(quantiles))
    lengths = draws.round().clamp(1, LENGTH_CAP * args.mean_len).long()
    return lengths[torch.randperm(n, generator=gen)].tolist()


def rank_samples(
    args: argparse.Namespace, lengths: list[int], rank: int
) -> tuple[list[Sample], torch.Tensor]:
    """This rank's samples (prompt, response token ids) with its slice of ``lengths``,
    and their advantages (seeded per rank); prompts of ``--prompt-len``/2 to
    ``--prompt-len`` tokens."""
    gen = torch.Generator().manual_seed(1000 * args.seed + 1 + rank)
    samples: list[Sample] = []
    for length in lengths[rank * args.samples : (rank + 1) * args.samples]:
        low = max(1, args.prompt_len // 2)
        prompt_len = int(torch.randint(low, args.prompt_len + 1, (1,), generator=gen))
        prompt = torch.randint(1, args.vocab, (prompt_len,), generator=gen).tolist()
        samples.append((prompt, torch.randint(1, args.vocab, (length,), generator=gen).tolist()))
    advantages = torch.randn(args.samples, generator=gen)
    return samples, advantages


def build_model(args: argparse.Namespace) -> Any:
    """The Qwen2ForCausalLM of the options, from a config, seeded: the same weights on
    every rank and side."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    longest = args.prompt_len + LENGTH_CAP * args.mean_len
    fields: dict[str, Any] = {
        "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(2048, longest), "attn_implementation": "sdpa",
    }  # fmt: skip
    return Qwen2ForCausalLM(Qwen2Config(**fields))


def padded_area(lengths: list[int], micro_batch: int) -> int:
    """The largest token area (rows x width) of this rank's fixed micro-batches of
    ``micro_batch`` consecutive samples, as ``build_batch`` pads them."""
    chunks = [lengths[i : i + micro_batch] for i in range(0, len(lengths), micro_batch)]
    return max(len(chunk) * max(chunk) for chunk in chunks)


# -- measuring ---------------------------------------------------------------------------
def _malloc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)`` (hand the heap's free memory back to the system), or
    a no-op where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return functools.partial(trim, 0)


class PeakRss:
    """The largest resident set size of this process during a ``with`` block, less the
    RSS at its start (bytes; None where there is no /proc/self/statm), sampled every
    ``interval`` seconds by a background thread. glibc keeps memory freed to its heap
    resident for reuse, so the block starts with ``malloc_trim(0)``: what the block
    reuses of it counts again."""

    trim = staticmethod(_malloc_trim())

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.growth: int | None = None
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._peak = 0
        self._thread: threading.Thread | None = None
        try:
            self._statm: Any = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115
        except OSError:
            self._statm = None

    def _rss(self) -> int:
        self._statm.seek(0)
        return int(self._statm.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._rss())

    def __enter__(self) -> PeakRss:
        if self._statm is not None:
            self.trim()
            self._base = self._peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.growth = max(self._peak, self._rss()) - self._base
        if self._statm is not None:
            self._statm.close()


class Side:
    """One way of splitting the step: its strategy, its copy of the model, what its
    steps computed and how much memory they took."""

    def __init__(
        self,
        name: str,
        strategy: Any,
        args: argparse.Namespace,
        samples: list[Sample],
        advantages: torch.Tensor,
    ) -> None:
        self.name = name
        self.strategy = strategy
        model = build_model(args)
        if strategy.config.packing_samples:
            model = use_packed_attention(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        (self.model, self.optim, self.sched), *_ = strategy.prepare_models_and_optimizers(
            model, None, None, None, None, max_steps=100_000
        )
        self.samples = samples
        self.advantages = advantages
        self.lengths = [len(p) + len(c) for p, c in samples]
        self.loss_tokens = [len(c) for _, c in samples]
        self.interval = args.sample_ms / 1e3
        self.grads: dict[str, torch.Tensor] = {}
        self.peak: int | None = None  # the largest RSS growth of the timed steps
        self.micro_batches = 0
        self.computed = 0  # tokens this rank's forwards computed in a step, padding included
        self.largest = 0  # tokens of this rank's largest micro-batch

    def step(self, grads: bool = False) -> None:
        """One optimizer step over every sample; with ``grads``, keep the step's full
        gradients in ``self.grads``."""
        strategy = self.strategy
        plan = strategy.plan_micro_batches(self.lengths, self.loss_tokens)
        self.micro_batches, self.computed, self.largest = plan.num_micro_batches, 0, 0
        with plan:
            for index, part in enumerate(plan.micro_batches):
                batch = build_batch(self.samples, part, plan.packed).to(strategy.device)
                self.computed += batch.num_tokens
                self.largest = max(self.largest, batch.num_tokens)
                logp, _ = token_logprobs(self.model, batch)
                adv = batch.per_token(self.advantages.to(logp.device))
                strategy.backward(plan.loss(-adv * logp, batch), self.model, self.optim)
                if grads and index == plan.num_micro_batches - 1:
                    self.grads = strategy.full_gradients(self.model)
                strategy.optimizer_step(self.optim, self.model, self.sched)

    def timed_step(self) -> float:
        """Seconds of one step (barrier to barrier), its peak RSS growth recorded."""
        with PeakRss(self.interval) as peak:
            seconds = timed(self.step)
        if peak.growth is not None:
            self.peak = max(self.peak or 0, peak.growth)
        return seconds


# -- entry points ------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = parser.add_argument_group("the samples")
    data.add_argument("--samples", type=int, default=32, help="samples per rank")
    data.add_argument("--mean-len", type=int, default=48, help="mean response tokens")
    data.add_argument("--sigma", type=float, default=1.2, help="log-normal spread of lengths")
    data.add_argument("--prompt-len", type=int, default=16, help="longest prompt (tokens)")
    model = parser.add_argument_group("the model (Qwen2ForCausalLM)")
    model.add_argument("--hidden", type=int, default=512)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=8)
    model.add_argument("--kv-heads", type=int, default=4)
    model.add_argument("--vocab", type=int, default=16384)
    train = parser.add_argument_group("training")
    train.add_argument("--backend", choices=["fsdp2", "deepspeed"], default="fsdp2")
    train.add_argument("--zero-stage", type=int, default=3, help="with --backend deepspeed")
    train.add_argument("--micro-batch", type=int, default=4, help="samples per padded micro-batch")
    train.add_argument(
        "--budget",
        type=int,
        default=None,
        help="max_tokens_per_gpu of the packed side (default: the largest padded "
        "micro-batch's rows x width over the ranks)",
    )
    train.add_argument(
        "--steps", type=int, default=3, help="timed steps per side, after one warm-up"
    )
    train.add_argument("--lr", type=float, default=1e-5)
    train.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-ms", type=float, default=2.0, help="RSS sampling period")
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes when re-launching under torchrun"
    )
    args = parser.parse_args()
    # what _common.strategy_config reads besides the above
    args.accum = math.ceil(args.samples / args.micro_batch)
    args.max_norm, args.weight_decay = 1.0, 0.0
    return args


def _quiet(backend: str) -> None:
    quiet_logger("lightrft.strategy.print")
    if backend == "deepspeed":
        importlib.import_module("deepspeed")
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        # DeepSpeed's communication layer calls torch's deprecated collective names
        warnings.filterwarnings(
            "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def main() -> None:
    args = parse_args()
    if not under_torchrun():
        sys.exit(relaunch_under_torchrun(__file__, args.nproc, ENV_DEFAULTS))
    _quiet(args.backend)

    world = int(os.environ["WORLD_SIZE"])
    backend: dict[str, Any] = {"backend": args.backend}
    if args.backend == "deepspeed":
        backend["zero_stage"] = args.zero_stage
    # the first strategy creates the gloo group; the second joins it
    padded_strategy = get_strategy(strategy_config(args, world, **backend))
    rank = dist.get_rank()
    samples, advantages = rank_samples(args, response_lengths(args, world), rank)
    lengths = [len(p) + len(c) for p, c in samples]
    budget = args.budget
    if budget is None:
        area = torch.tensor(padded_area(lengths, args.micro_batch))
        dist.all_reduce(area, op=dist.ReduceOp.MAX)
        budget = int(area)
    packed_strategy = get_strategy(
        strategy_config(args, world, **backend, packing_samples=True, max_tokens_per_gpu=budget)
    )
    padded = Side("padded", padded_strategy, args, samples, advantages)
    packed = Side("packed", packed_strategy, args, samples, advantages)
    sides = [padded, packed]

    every: list[Any] = [None] * world
    dist.all_gather_object(every, (lengths, [len(c) for _, c in samples]))
    all_responses = [n for _, responses in every for n in responses]
    real_tokens = sum(sum(n) for n, _ in every)  # every token of every sample, prompts too
    if rank == 0:
        stage = f" ZeRO-{args.zero_stage}" if args.backend == "deepspeed" else ""
        print(
            f"{args.backend}{stage} on CPU/gloo, {world} processes x {torch.get_num_threads()} "
            f"threads, fp32; Qwen2ForCausalLM {args.layers} layers, hidden {args.hidden}, "
            f"{args.heads} heads ({args.kv_heads} key-value), vocab {args.vocab}: "
            f"{padded.n_params / 1e6:.2f} M parameters"
        )
        mean = statistics.mean(all_responses)
        print(
            f"samples: {args.samples} per rank, responses log-normal (sigma {args.sigma}): mean "
            f"{mean:.1f}, median {statistics.median(all_responses):.0f}, longest "
            f"{max(all_responses)} tokens ({max(all_responses) / mean:.1f}x the mean), "
            f"prompts {max(1, args.prompt_len // 2)}-{args.prompt_len}; "
            f"{real_tokens} tokens in all"
        )
        print(
            f"padded: micro-batches of {args.micro_batch} samples; packed: "
            f"max_tokens_per_gpu {budget}"
            + (" (the largest padded micro-batch's rows x width)" if args.budget is None else "")
        )
        print(f"one warm-up step per side (gradients compared), then {args.steps} timed rounds")

    # the warm-up: both sides' first step on the same weights, gradients compared
    padded.step(grads=True)
    packed.step(grads=True)
    diff, scale = torch.zeros(()), torch.zeros(())
    for name, grad in padded.grads.items():
        diff = torch.maximum(diff, (grad - packed.grads[name]).abs().max())
        scale = torch.maximum(scale, grad.abs().max())
    padded.grads, packed.grads = {}, {}
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)

    dist.barrier()
    run_start = start_figures()
    times = interleaved(
        {side.name: side.timed_step for side in sides},
        args.steps,
        "training",
        progress=rank == 0,
    )
    others = other_processes_cpus(*run_start)

    figures = [(side.micro_batches, side.computed, side.largest, side.peak) for side in sides]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        report_other_processes(others)
        peaks: dict[str, int | None] = {}
        for i, side in enumerate(sides):
            computed = sum(g[i][1] for g in gathered)
            per_rank: list[int | None] = [g[i][3] for g in gathered]
            known = [p for p in per_rank if p is not None]
            peaks[side.name] = max(known) if len(known) == world else None
            counts = ", ".join(str(g[i][0]) for g in gathered)
            largest = ", ".join(str(g[i][2]) for g in gathered)
            print(
                f"{side.name}: {counts} micro-batches per rank, {computed} tokens computed per "
                f"step ({(computed - real_tokens) / computed:.1%} padding), largest micro-batch "
                f"{largest} tokens per rank"
            )
            print(
                f"  step {statistics.median(times[side.name]):.3f} s median "
                f"(range {min(times[side.name]):.3f} .. {max(times[side.name]):.3f}); "
                f"peak RSS growth per rank {', '.join(_mib(p) for p in per_rank)}"
            )
        t_padded = statistics.median(times[padded.name])
        t_packed = statistics.median(times[packed.name])
        computed = sum(g[0][1] for g in gathered)
        padded_share = (computed - real_tokens) / computed
        print(f"padded fraction of the fixed run: {padded_share:.1%} of the tokens it computes")
        print(f"first-step gradients: largest |grad| {float(scale):.3g}, largest difference "
              f"{float(diff):.3g}")  # fmt: skip
        mem_p, mem_q = peaks[padded.name], peaks[packed.name]
        memory = "n/a" if not mem_p or mem_q is None else f"{mem_q / mem_p:.2f}x"
        print(
            f"dynamic_batch: padded {t_padded:.3f} s, packed {t_packed:.3f} s, speedup "
            f"{t_padded / t_packed:.2f}x, peak memory {memory}, grad max diff {float(diff):.3g}"
        )
        sys.stdout.flush()

    packed_strategy.close()  # joined the group: releases its model
    padded_strategy.close()  # barrier, then destroys the process group it created


if __name__ == "__main__":
    main()
