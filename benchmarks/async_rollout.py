"""Benchmark the demo's RL step with the engine colocated against an engine rank of its own.

Three runs of ``examples/grpo.py``'s RL phase on the same ``--nproc`` (2) CPU processes,
from the same warm-up model, the same ``--steps`` (40), prompts, seeds and settings:

* **colocated**: every rank trains and serves (the demo's default), in turns;
* **separate+sync**: ``--engine_placement separate --max_staleness 0``: the last rank
  serves, the others train; each step's rollouts are generated after the step's sync,
  from the newest weights, while the trainer waits;
* **one-step-off**: ``--max_staleness 1``: step ``s+1``'s rollouts are generated while
  step ``s`` trains, from the weights before it (``weight_lag`` 1).

A step's time is the wall clock on trainer rank 0 around ``Run.step`` (sync, waiting
for the rollouts, rewards, training), its median over the steps. Printed per run:
seconds per step, the fraction of it the trainer waits (the sync and the wait for
rollouts), for the separate runs the fraction the engine rank waits (1 - its busy
time, generating or loading weights, over the loop's time), and the weight transfer
(seconds and bytes of one sync: gathering, the channel and the engine's load; from the
separate+sync run, where no generation is in flight during a sync). The last line
(one line; folded here):

    async_rollout: colocated <s> s/step, separate+sync <s> s/step,
    one-step-off <s> s/step, transfer <ms> ms

Run it from an environment with the strategy and the HF engine (the ``demo`` or
``bench`` session's): ``python benchmarks/async_rollout.py [--warm-model DIR] [-- demo
flags]`` (the flags after ``--`` go to every run, e.g. ``--device cuda``).

What the CPU figures say: here the trainer and the engine rank split 2 cores (one thread
each), and the colocated run trains on 2 ranks where the separate ones train on 1, so
the separate runs' training part is about twice as long; one-step-off hides the
generation behind it. On GPUs the engine ranks are whole devices generating with
vLLM/SGLang kernels and the transfer goes over NVLink/IB with NCCL (here gloo over
loopback), so the ratios do not carry over: what carries over is the wait structure
(separate+sync waits for generation every step, one-step-off does not when
generation is shorter than training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vs_trl import EXAMPLES, ROOT, step_figures, torchrun, warm_model

FLAG = "--async-rollout-result"
RUNS = {
    "colocated": [],
    "separate+sync": ["--engine_placement", "separate", "--max_staleness", "0"],
    "one-step-off": ["--engine_placement", "separate", "--max_staleness", "1"],
}


def run_side(result: Path, job: list[str]) -> int:
    """In one rank under torchrun: the demo's ``main`` with each ``Run.step`` timed, and
    at the last step the engine ranks' busy seconds; trainer rank 0 writes them."""
    sys.path.insert(0, str(EXAMPLES))
    import grpo

    spans: list[dict[str, float]] = []
    busy: list[float] = []
    step = grpo.Run.step

    def engine_busy(run: grpo.Run) -> list[float]:  # (collective over the trainer ranks)
        remote = run.strategy.engine_link.remote
        return [s["busy_s"] for s in remote.stats()] if remote is not None else []

    def timed_step(self: grpo.Run, number: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if not spans:  # the engine ranks' busy seconds over the loop: from here
            busy[:] = engine_busy(self)
        begin = time.perf_counter()
        out = step(self, number)
        spans.append({"step": number, "begin": begin, "end": time.perf_counter()})
        if number == self.total:
            busy[:] = [b - a for a, b in zip(busy, engine_busy(self), strict=True)]
        return out

    grpo.Run.step = timed_step  # type: ignore[method-assign, assignment]
    code = grpo.main(job)
    if os.environ.get("RANK", "0") == "0":
        result.write_text(json.dumps({"spans": spans, "engine_busy_s": busy}) + "\n")
    return int(code)


def measure(args: argparse.Namespace, warm: Path) -> dict[str, dict[str, Any]]:
    steps = str(args.steps)
    job = ["--pretrain", str(warm), "--recipe", "demo", "--sft-steps", "0", "--steps", steps,
           "--min-gain", "-1", "--eval-every", steps, "--save-every", steps,
           *args.demo_flags]  # fmt: skip
    found = {}
    for name, flags in RUNS.items():
        out = args.out / name.replace("+", "_")
        result = args.out / f"{name.replace('+', '_')}.json"
        print(f"{name}: examples/grpo.py {' '.join(flags)}", flush=True)
        torchrun(
            args.nproc, Path(__file__).resolve(),
            [FLAG, str(result), "--", *job, *flags, "--out", str(out)],
            args.out / f"{out.name}.log",
        )  # fmt: skip
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        found[name] = {**json.loads(result.read_text()), "rows": rows}
    return found


def report(found: dict[str, dict[str, Any]]) -> str:
    figures = {}
    for name, run in found.items():
        rl = {r["step"]: r for r in run["rows"] if r.get("phase") == "rl"}
        spans = [s for s in run["spans"] if s["step"] in rl]
        step = step_figures(spans)
        waits = [
            (rl[s["step"]]["generate_s"] + rl[s["step"]]["sync_s"]) / (s["end"] - s["begin"])
            for s in spans
        ]
        loop = spans[-1]["end"] - spans[0]["begin"]
        busy = run["engine_busy_s"]
        engine_wait = f", engine rank waits {max(0.0, 1 - max(busy) / loop):.0%}" if busy else ""
        lags = sorted({int(r.get("weight_lag", 0)) for r in rl.values()})
        synced = [r for r in rl.values() if r.get("sync_bytes")]
        transfer = statistics.median(r["sync_s"] for r in synced) if synced else 0.0
        nbytes = synced[0]["sync_bytes"] if synced else 0
        first, last = (statistics.mean(r["reward"] for r in part) for part in
                       (list(rl.values())[:10], list(rl.values())[-10:]))  # fmt: skip
        print(
            f"{name}: median {step['median']:.4f} s/step (loop {step['loop']:.4f}); the "
            f"trainer waits {statistics.median(waits):.0%}{engine_wait}; weight_lag {lags}; "
            f"sync {transfer * 1e3:.1f} ms for {nbytes / 1e6:.2f} MB; reward {first:.3f} -> "
            f"{last:.3f}"
        )
        figures[name] = (step["median"], transfer)
    return (
        f"async_rollout: colocated {figures['colocated'][0]:.3f} s/step, separate+sync "
        f"{figures['separate+sync'][0]:.3f} s/step, one-step-off "
        f"{figures['one-step-off'][0]:.3f} s/step, transfer "
        f"{figures['separate+sync'][1] * 1e3:.1f} ms"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == [FLAG]:  # one run, inside torchrun
        job = argv[2:]
        return run_side(Path(argv[1]), job[1:] if job[:1] == ["--"] else job)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "async_rollout")
    parser.add_argument(
        "--warm-model",
        type=Path,
        default=None,
        help="the warm-up model (default: build it with the demo's warm-up)",
    )
    parser.add_argument("--sft-steps", type=int, default=150, help="warm-up steps when building")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke check: 3 steps from a 5-step warm-up (measures nothing)",
    )
    # after --: flags for every run of the demo (the GPU check passes --device cuda)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if extra else 0)])
    args.demo_flags = extra
    if args.quick:
        args.steps, args.sft_steps = 3, 5
    args.out = args.out.resolve()
    print(report(measure(args, warm_model(args).resolve())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
