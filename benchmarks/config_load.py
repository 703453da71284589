"""Benchmark lightrft.config against the upstream-style dataclass config.

Measures, in the same run:
  * cold import time (a fresh interpreter per sample), and
  * `from_args` on a 60-attribute argparse namespace (45 config fields + 15 others),
and prints each figure with the ratio ours / upstream-style.

    python benchmarks/config_load.py [--imports 15] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from lightrft.config import StrategyConfig  # noqa: E402
from upstream_style_config import UpstreamStrategyConfig  # noqa: E402

IMPORT_PROBE = (
    "import sys, time; sys.path.insert(0, {here!r}); t = time.perf_counter(); "
    "import {module}; print(time.perf_counter() - t)"
)


def cold_import_seconds(module: str) -> float:
    code = IMPORT_PROBE.format(here=str(HERE), module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def namespace_60() -> argparse.Namespace:
    values = {name: info.default for name, info in StrategyConfig.model_fields.items()}
    values.pop("extra_args")
    values = {k: v for k, v in values.items() if hasattr(UpstreamStrategyConfig, k)}
    values.update(zero_stage=3, adam_betas=[0.9, 0.99], seed=7)
    values.update({f"trainer_option_{i}": i for i in range(60 - len(values))})
    assert len(values) == 60, len(values)
    return argparse.Namespace(**values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--imports", type=int, default=15, help="cold-import samples per side")
    parser.add_argument("--calls", type=int, default=2000, help="from_args calls per sample")
    args = parser.parse_args()

    print(f"cold import, median of {args.imports} fresh interpreters (interleaved):")
    ours, theirs, bare = [], [], []
    for i in range(args.imports):
        ours.append(cold_import_seconds("lightrft.config"))
        theirs.append(cold_import_seconds("upstream_style_config"))
        bare.append(cold_import_seconds("pydantic.main"))
        print(f"\r  sample {i + 1}/{args.imports}", end="", file=sys.stderr)
    print(file=sys.stderr)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"  lightrft.config        {o * 1e3:8.2f} ms")
    print(f"  upstream-style config  {t * 1e3:8.2f} ms")
    p = statistics.median(bare)
    print(f"  pydantic alone         {p * 1e3:8.2f} ms   (ours minus it: {(o - p) * 1e3:.2f} ms)")
    print(f"  ratio ours/upstream    {o / t:8.2f}x   (difference {(o - t) * 1e3:.2f} ms)")

    ns = namespace_60()
    assert (
        StrategyConfig.from_args(ns).zero_stage == UpstreamStrategyConfig.from_args(ns).zero_stage
    )
    print(f"from_args on a 60-attribute namespace, best of 5 x {args.calls} calls:")
    ours_s = min(timeit.repeat(lambda: StrategyConfig.from_args(ns), number=args.calls, repeat=5))
    theirs_s = min(
        timeit.repeat(lambda: UpstreamStrategyConfig.from_args(ns), number=args.calls, repeat=5)
    )
    o, t = ours_s / args.calls, theirs_s / args.calls
    print(f"  StrategyConfig.from_args (validated)  {o * 1e6:8.1f} us")
    print(f"  upstream-style from_args (no checks)  {t * 1e6:8.1f} us")
    print(f"  ratio ours/upstream                   {o / t:8.2f}x")


if __name__ == "__main__":
    main()
