"""Launch a small train-save-exit job many times under torchrun and count clean exits.

Each launch runs ``packages/lightrft-strategy/tests/scripts/train_save_exit.py``, a plain
user script (build a strategy, train a step, save a checkpoint, close, return; no
``os._exit``), and counts as clean when every torchrun exits 0 and the job's report was
written. Launches alternate between no engine and the fake engine (weight sync and
generation). A failed launch is listed with the tail of its output.

    python tools/stress_launches.py                      # 50 FSDP2, 50 ZeRO-3, 20 two-node
    python tools/stress_launches.py --launches 3 --two-node 1
    python tools/stress_launches.py --rebuilds 20 --launches 1 --two-node 0
    python tools/stress_launches.py --no-close --load 2 --launches 30 --backends fsdp2 --two-node 0

Needs lightrft-strategy with its ``deepspeed`` extra and lightrft-testing (``nox -s
stress`` installs them). Exit status 1 when any launch was not clean.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lightrft.testing.launcher import RankFailure, run_torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "packages" / "lightrft-strategy" / "tests" / "scripts" / "train_save_exit.py"


@dataclass
class Case:
    name: str
    backend: str
    nnodes: int
    nproc_per_node: int
    launches: int
    clean: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def launch(
    case: Case, engine: str, rebuilds: int, timeout: float, close: bool = True
) -> str | None:
    """One launch; None when clean, else why not."""
    with tempfile.TemporaryDirectory(prefix="stress-") as out:
        args = [out, "--backend", case.backend, "--engine", engine]
        args += ["--rebuilds", str(rebuilds)] + ([] if close else ["--no-close"])
        try:
            run_torchrun(
                SCRIPT, *args, nnodes=case.nnodes, nproc_per_node=case.nproc_per_node,
                timeout=timeout,
            )  # fmt: skip
        except (RankFailure, TimeoutError) as error:
            return str(error)[-1500:]
        if not (Path(out) / "report.json").is_file():
            return "every torchrun exited 0, but the job wrote no report.json"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description="Count clean exits of repeated launches.")
    parser.add_argument("--launches", type=int, default=50, help="per one-node backend")
    parser.add_argument("--two-node", type=int, default=20, help="two-node FSDP2 launches")
    parser.add_argument("--backends", nargs="+", default=["fsdp2", "zero3"])
    parser.add_argument("--rebuilds", type=int, default=0, help="close-and-rebuild per job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument(
        "--no-close", action="store_true", help="leave the strategy open at interpreter exit"
    )
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    args = parser.parse_args()
    spin = "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.load)]
    try:
        return _run(args)
    finally:
        for process in busy:
            process.kill()


def _run(args: argparse.Namespace) -> int:
    cases = [Case(f"{b}, 1 node x 2 ranks", b, 1, 2, args.launches) for b in args.backends]
    if args.two_node:
        cases.append(Case("fsdp2, 2 nodes x 1 rank (loopback)", "fsdp2", 2, 1, args.two_node))
    for case in cases:
        for index in range(case.launches):
            engine = "fake" if index % 2 else "none"
            start = time.monotonic()
            why = launch(case, engine, args.rebuilds, args.timeout, close=not args.no_close)
            case.seconds.append(time.monotonic() - start)
            if why is None:
                case.clean[engine] += 1
            else:
                case.failed.append(f"launch {index + 1} (engine {engine}): {why}")
            status = "clean" if why is None else "NOT CLEAN"
            print(f"{case.name}: launch {index + 1}/{case.launches} {status} "
                  f"({case.seconds[-1]:.1f} s)", flush=True)  # fmt: skip
    print("\n| job | clean exits | no engine | fake engine | s per launch |")
    print("|---|---|---|---|---|")
    for case in cases:
        clean = sum(case.clean.values())
        mean = sum(case.seconds) / max(1, len(case.seconds))
        print(f"| {case.name} | {clean}/{case.launches} | {case.clean['none']} | "
              f"{case.clean['fake']} | {mean:.1f} |")  # fmt: skip
    failures = [f"{case.name}, {why}" for case in cases for why in case.failed]
    for failure in failures:
        print(f"\n--- {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
