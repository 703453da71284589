#!/usr/bin/env python3
"""The GPU checks on a GPU machine that reaches no package registry.

`nox -s gpu` is the GPU check where a GPU machine can install from uv.lock. Cluster
nodes often cannot; this carries what they lack and runs the same tests there:

    python3 tools/gpu_offline.py bundle .gpu         # here, with registries (uv on PATH
                                                     # or in .tools/)
    python3 tools/gpu_offline.py check .gpu OUT      # there, with the GPU's own python3

bundle writes into DIR the wheels of the four distributions (`uv build`) and the uv.lock
versions of the packages a PyTorch+CUDA image usually lacks (pydantic and its parts,
DeepSpeed and hjson, pytest-timeout), for CPython 3.12 on x86-64 Linux
(``--python-version``).

check installs DIR's wheels without dependencies into a folder on PYTHONPATH (the
machine's torch, transformers and pytest are used as they are), prints the environment,
then runs each step below, its output in OUT/<step>.log (the demos' metrics, every
row naming its run, in OUT/demo-metrics.jsonl):

    doctor     `lightrft doctor`
    demo-*     the GRPO demo on CUDA, one rank per GPU (2 at most): FSDP2 (engine asleep while
               training, every sync verified), then DeepSpeed ZeRO-2 and ZeRO-3
    strategy   pytest -m gpu on lightrft-strategy (FSDP2 and DeepSpeed on CUDA)
    engines-hf the Hugging Face engine's GPU tests (lightrft-engines)
    engines    pytest -m "gpu and vllm|sglang" on lightrft-engines, for each of vLLM
               and SGLang that imports (a missing one is reported as not run)
    bench-sp   benchmarks/sequence_parallel.py on 2 GPUs (NCCL), sequences of 4k-64k
               tokens (with one GPU it is reported as not run)
    bench-async benchmarks/async_rollout.py on 2 GPUs: the demo colocated, then with an
               engine rank of its own at max_staleness 0 and 1 (one GPU: not run)

It exits 1 if any step failed; a summary table ends the output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["lightrft-config", "lightrft-strategy", "lightrft-engines", "lightrft-testing"]
# what a PyTorch+CUDA image lacks of our dependencies (the rest: torch, transformers,
# click, pyyaml, safetensors, numpy, pytest, DeepSpeed's einops, msgpack, ninja, psutil,
# py-cpuinfo, tqdm, are taken from the machine); pytest-timeout too, which the H200's
# image had, since without it the tests' timeout marks fail collection (--strict-markers)
CARRIED = [
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "hjson",
    "deepspeed",
    "pytest-timeout",
    # the demos' run log (lightrft-strategy[tracking]): matplotlib and TensorBoard with
    # what they need beyond numpy, packaging and tqdm
    "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing",
    "python-dateutil", "six", "pillow",
    "tensorboard", "tensorboard-data-server", "absl-py", "grpcio", "markdown", "protobuf",
    "werkzeug", "markupsafe",
]  # fmt: skip
SOURCE_ONLY = {"deepspeed"}  # published as an sdist only: built into a wheel here


def locked_versions(names: list[str]) -> dict[str, str]:
    """The first version uv.lock records of each name (tomllib is Python 3.11+)."""
    found: dict[str, str] = {}
    pairs = re.findall(
        r'^name = "([^"]+)"\nversion = "([^"]+)"', (ROOT / "uv.lock").read_text(), re.M
    )
    for name, version in pairs:
        if name in names:
            found.setdefault(name, version)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"gpu_offline: uv.lock has no version of {', '.join(missing)}")
    return found


def uv() -> str:
    for candidate in (shutil.which("uv"), ROOT / ".tools" / "bin" / "uv"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit(
        "gpu_offline: uv not found: run `python3 dev.py nox --list` once (it installs .tools/)"
    )


def bundle(out: Path, python_version: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    for name in PACKAGES:
        subprocess.run(
            [uv(), "build", "--wheel", "--package", name, "-o", str(out)], cwd=ROOT, check=True
        )
    versions = locked_versions(CARRIED)
    binary = [f"{n}=={versions[n]}" for n in CARRIED if n not in SOURCE_ONLY]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         f"--python-version={python_version}", "--implementation=cp", *platforms,
         "--platform=manylinux2014_x86_64", "-d", str(out), *binary],
        check=True,
    )  # fmt: skip
    for name in SOURCE_ONLY:
        src = out / "sdist"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:",
             "-d", str(src), f"{name}=={versions[name]}"],
            check=True,
        )  # fmt: skip
        for archive in src.glob("*.tar.gz"):
            # DeepSpeed builds no ops into the wheel unless asked (DS_BUILD_OPS): they are
            # compiled on first use, on the GPU machine, against its CUDA
            subprocess.run([uv(), "build", "--wheel", str(archive), "-o", str(out)], check=True)
        shutil.rmtree(src)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    print(f"gpu_offline: {len(wheels)} wheels, {size:.1f} MiB in {out}:\n  " + "\n  ".join(wheels))
    return 0


def run_step(
    name: str, cmd: list[str], out: Path, env: dict[str, str], cwd: Path, timeout: int
) -> str:
    log = out / f"{name}.log"
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # with the ranks it started
            proc.wait()
            rc = None
    took = time.monotonic() - start
    lines = log.read_text(errors="replace").splitlines()
    print("\n".join(lines[-25:]), flush=True)
    status = "passed" if rc == 0 else ("timed out" if rc is None else f"FAILED (exit {rc})")
    return f"{name:<16} {status:<18} {took:7.1f} s"


def check(wheels: Path, out: Path, site: Path, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(
            f"gpu_offline: no wheels in {wheels}: run `gpu_offline.py bundle {wheels}` first"
        )
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *found],
        check=False,
    )  # fmt: skip
    if installed.returncode:
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise SystemExit(
            f"gpu_offline: pip could not install the wheels in {wheels} (above). If it "
            f"rejected a wheel as unsupported, they were bundled for another Python: "
            f"this one is {here}; run `gpu_offline.py bundle {wheels} --python-version "
            f"{here}` where a registry is reachable"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    facts = (
        "import sys, sysconfig, torch, transformers, deepspeed, pydantic;"
        "print('python', sys.version.split()[0], 'Python.h:', __import__('os').path.exists("
        "sysconfig.get_paths()['include'] + '/Python.h'));"
        "print('torch', torch.__version__, 'cuda', torch.version.cuda,"
        "'gpus', torch.cuda.device_count(),"
        "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-');"
        "print('transformers', transformers.__version__, 'deepspeed', deepspeed.__version__,"
        "'pydantic', pydantic.__version__)"
    )
    subprocess.run([sys.executable, "-c", facts], env=env, check=False)
    gpus = int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        env=env, capture_output=True, text=True, check=False,
    ).stdout.strip() or 0)  # fmt: skip
    strategy_dir = ROOT / "packages" / "lightrft-strategy"
    engines_dir = ROOT / "packages" / "lightrft-engines"
    pytest = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE"]
    ranks = min(max(gpus, 1), 2)  # the demo's batch splits over 1 or 2 ranks
    demo = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
            str(ROOT / "examples" / "grpo.py"), "--device", "cuda"]  # fmt: skip
    runs = site.parent / "lightrft-gpu-runs"  # the demos' run directories (checkpoints)
    # name: (command, folder, time limit in seconds)
    steps: dict[str, tuple[list[str], Path, int]] = {
        "doctor": ([sys.executable, "-m", "lightrft.strategy.cli", "doctor"], ROOT, 120),
        "demo-fsdp2": (
            [
                *demo,
                "--enable_engine_sleep",
                "--verify_engine_sync",
                "--out",
                str(runs / "demo-fsdp2"),
            ],
            ROOT,
            300,
        ),
        **{
            f"demo-zero{stage}": (
                [
                    *demo,
                    "--backend",
                    "deepspeed",
                    "--zero_stage",
                    str(stage),
                    "--out",
                    str(runs / f"demo-zero{stage}"),
                ],
                ROOT,
                300,
            )
            for stage in (2, 3)
        },
        "strategy": ([*pytest, "--durations=0", "-m", "gpu"], strategy_dir, 1200),
        "engines-hf": ([*pytest, "-m", "gpu and not vllm and not sglang"], engines_dir, 600),
    }
    if gpus >= 2:  # sequence parallelism over 2 GPUs (NCCL); one GPU cannot hold 2 ranks
        steps["bench-sp"] = (
            [sys.executable, str(ROOT / "benchmarks" / "sequence_parallel.py"), "--device",
             "cuda", "--lengths", "4096", "16384", "65536", "--hidden", "1024", "--layers", "8",
             "--heads", "16", "--kv-heads", "8", "--vocab", "32000"],
            ROOT,
            900,
        )  # fmt: skip
        steps["bench-async"] = (
            [sys.executable, str(ROOT / "benchmarks" / "async_rollout.py"), "--steps", "20",
             "--out", str(runs / "bench-async"), "--", "--device", "cuda"],
            ROOT,
            900,
        )  # fmt: skip
    else:
        print("gpu_offline: bench-sp and bench-async need 2 GPUs: NOT run")
    for engine in ("vllm", "sglang"):
        probe = subprocess.run(
            [sys.executable, "-c", f"import {engine}"], env=env, capture_output=True, check=False
        )
        if probe.returncode == 0:
            steps[f"engines-{engine}"] = ([*pytest, "-m", f"gpu and {engine}"], engines_dir, 1200)
        else:
            print(f"gpu_offline: {engine} does not import here: its GPU tests are NOT run")
    unknown = sorted(set(only) - set(steps))
    if unknown:
        print(f"gpu_offline: --only {' '.join(unknown)}: no such step here; steps: "
              f"{', '.join(steps)}")  # fmt: skip
        return 2
    rows = []
    for name, (cmd, cwd, limit) in steps.items():
        if only and name not in only:
            continue
        rows.append(run_step(name, cmd, out, env, cwd, timeout=limit))
        metrics = runs / name / "metrics.jsonl"
        if metrics.is_file():  # every demo's rows in one file, each naming its run
            with (out / "demo-metrics.jsonl").open("a") as fh:
                for line in metrics.read_text().splitlines():
                    fh.write(json.dumps({"run": name, **json.loads(line)}) + "\n")
    print("\n=== summary\n" + "\n".join(rows))
    return 0 if rows and all(" passed " in r for r in rows) else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="here: build and download the wheels into DIR")
    b.add_argument("dir", type=Path)
    b.add_argument("--python-version", default="3.12")
    c = sub.add_parser("check", help="there: install DIR's wheels and run the GPU checks")
    c.add_argument("dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument(
        "--site",
        type=Path,
        default=Path("/tmp/lightrft-site"),
        help="where the wheels are installed",
    )
    c.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run only these steps (doctor, demo-fsdp2, demo-zero2, demo-zero3, strategy, "
        "engines-hf, engines-vllm, engines-sglang)",
    )
    args = parser.parse_args(argv)
    if args.command == "bundle":
        return bundle(args.dir, args.python_version)
    return check(args.dir, args.out, args.site, args.only)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
