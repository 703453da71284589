"""``lightrft config show|validate|schema`` (also ``python -m lightrft.config``): what a
configuration resolves to. Needs click (extra ``cli``); lightrft-strategy's ``lightrft``
command mounts this group.

Exit status: 0 when the command did what it was asked, 1 when the configuration is
invalid (every problem listed), 2 for a usage error (an unknown flag or command).

Values are layered as :meth:`StrategyConfig.from_argv` layers them: defaults < the
``--config`` file < ``LIGHTRFT_*`` environment variables < flags, and each value is
shown with the source that set it. Every ``StrategyConfig`` field is also a flag of
these commands (``--zero_stage 3``, ``--no-bf16``, ``--adam_betas 0.9 0.95``), parsed
by lightrft.config's own argparse flags.

Flag values are read as text and converted by the config's validation, as environment
variables are, so that ``validate`` reports every bad value at once instead of stopping
at the first one argparse would refuse. ``lightrft doctor`` resolves its configuration
here too.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click

from lightrft.config import ConfigError, ConfigProblem, StrategyConfig, sources
from lightrft.config.spelling import closest

#: ``context_settings`` of a command that hands options it does not define to the config.
PASS_THROUGH: dict[str, Any] = {"ignore_unknown_options": True, "allow_extra_args": True}

#: The source of a value no layer set.
DEFAULT = "default"
#: The source of a value no layer set that validation changed (``fsdp`` follows
#: ``backend='fsdp2'``, ``bf16`` follows ``precision``).
DERIVED = "derived from other fields"

_F = TypeVar("_F", bound=Callable[..., Any])


# -- resolving -------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration, as the commands report it.

    Attributes:
        field: the field at fault, or ``None`` when no single field is (a missing file).
        value: the value the field was given.
        source: where that value came from (``"command line --zero_stage"``, ...).
        message: what is wrong.
        fix: what to do about it (empty when the message says it).
    """

    field: str | None
    value: Any
    source: str | None
    message: str
    fix: str

    def as_dict(self) -> dict[str, Any]:
        """The problem as JSON-ready data."""
        return {
            "field": self.field,
            "value": self.value,
            "source": self.source,
            "message": self.message,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Resolved:
    """A configuration layered from a file, the environment and flags.

    Attributes:
        config: the validated configuration, or ``None`` when it has problems.
        values: the layered values before validation (unknown names included).
        origin: for each name some layer set, where its value came from.
        problems: everything wrong with it (empty when ``config`` is set).
    """

    config: StrategyConfig | None
    values: dict[str, Any]
    origin: dict[str, str]
    problems: list[Problem]

    def source(self, name: str) -> str:
        """Where the value of field ``name`` came from: a layer, ``default`` or
        ``derived from other fields``."""
        if name in self.origin:
            return self.origin[name]
        info = StrategyConfig.model_fields[name]
        if self.config is not None and getattr(self.config, name) != info.get_default(
            call_default_factory=True
        ):
            return DERIVED
        return DEFAULT

    @property
    def names_fields(self) -> bool:
        """Whether a file, variable or flag set any field (the defaults were not all)."""
        return any(name in StrategyConfig.model_fields for name in self.origin)


class _FlagParser(argparse.ArgumentParser):
    """argparse with errors raised as click usage errors (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise click.UsageError(f"config flags: {message}")


def _unknown_flags(tokens: Sequence[str]) -> click.UsageError:
    fields = [name for name in StrategyConfig.model_fields if name != "extra_args"]
    parts: list[str] = []
    for token in tokens:
        if not token.startswith("-"):
            continue
        name = token.lstrip("-").split("=", 1)[0].replace("-", "_")
        guess = closest(name, fields)
        hint = f" (did you mean --{guess}?)" if guess else ""
        parts.append(f"{token.split('=', 1)[0]}{hint}")
    if not parts:
        return click.UsageError(f"unexpected arguments: {' '.join(tokens)}")
    return click.UsageError(
        f"no such option: {', '.join(parts)}; every StrategyConfig field is a flag "
        "(`lightrft config schema` lists them)"
    )


def parse_flags(flags: Sequence[str]) -> dict[str, Any]:
    """The fields ``flags`` set (``["--zero_stage", "3"]`` -> ``{"zero_stage": "3"}``).

    The flags are lightrft.config's, but their values stay text (``none``/``null`` is
    ``None`` where a field may be null): the config's validation converts them, so it
    can report every bad one. An unknown flag is a :class:`click.UsageError`.
    """
    parser = _FlagParser(prog="lightrft config", add_help=False)
    StrategyConfig.add_arguments(parser, suppress_defaults=True)
    fields = StrategyConfig.model_fields
    for action in parser._actions:
        if action.dest in fields:
            action.type = None
            action.choices = None
    namespace, unknown = parser.parse_known_args(list(flags))
    if unknown:
        raise _unknown_flags(unknown)
    given: dict[str, Any] = {}
    for name, value in vars(namespace).items():
        if isinstance(value, str):
            value = sources.parse_text(name, fields[name], value, f"command line --{name}")
        given[name] = value
    return given


def explain(
    problem: ConfigProblem, values: Mapping[str, Any], origin: Mapping[str, str]
) -> Problem:
    """A :class:`Problem` naming the field, its value and source, and the fix, read
    from the structured :class:`ConfigProblem` (a rule joining several fields names the
    field to change first and carries its own fix)."""
    fields = StrategyConfig.model_fields
    if problem.field is None:
        return Problem(None, None, None, problem.message, problem.fix or "")
    if problem.fix is not None:
        fix = problem.fix
    elif problem.accepted:
        fix = f"set {problem.field} to {problem.accepted}"
    else:
        fix = f"see `lightrft config schema` for what {problem.field} accepts"
    source = problem.source or origin.get(problem.field)
    if source is None and problem.field in fields:
        source = DEFAULT
    value = values.get(problem.field, problem.value) if problem.fix is not None else problem.value
    return Problem(problem.field, value, source, problem.message, fix)


def resolve(
    config_file: str | None, flags: Sequence[str], environ: Mapping[str, str] | None = None
) -> Resolved:
    """Layer ``config_file``, ``environ`` (``os.environ`` by default) and ``flags``
    as :meth:`StrategyConfig.from_argv` does, keeping each value's source and every
    problem found. Unknown flags raise :class:`click.UsageError`."""
    given = parse_flags(flags)
    environ = os.environ if environ is None else environ
    try:
        layers = sources.collect_layers(
            StrategyConfig, file=config_file, environ=environ, args=given
        )
    except ConfigError as exc:  # an unreadable file, or bad JSON in a variable
        return Resolved(None, {}, {}, [explain(p, {}, {}) for p in exc.problems])
    values, origin = sources.merge_layers(layers)
    try:
        config = StrategyConfig.load(file=config_file, environ=environ, args=given)
    except ConfigError as exc:
        return Resolved(None, values, origin, [explain(p, values, origin) for p in exc.problems])
    return Resolved(config, values, origin, [])


def unknown_names(resolved: Resolved) -> list[Problem]:
    """A problem for each name that is not a field (``from_args`` keeps those in
    ``extra_args`` for the trainer), suggesting the field it may misspell."""
    if resolved.config is None:
        return []
    fields = [name for name in StrategyConfig.model_fields if name != "extra_args"]
    problems = []
    for name, value in sorted(resolved.config.extra_args.items()):
        guess = closest(name, fields)
        fix = f"rename it to {guess}" if guess else "remove it, or drop --strict"
        message = "not a StrategyConfig field (kept in extra_args)"
        problems.append(Problem(name, value, resolved.origin.get(name), message, fix))
    return problems


# -- output ----------------------------------------------------------------------------
def display(value: Any, source: str | None) -> str:
    """``value`` as text: as typed when it came from a flag or a variable (still
    unconverted when it is invalid), else its ``repr``."""
    flag = source is not None and source.startswith("command line ")
    variable = source is not None and source.startswith("environment variable ")
    if (flag or variable) and isinstance(value, str):
        return value
    if (flag or variable) and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return (" " if flag else ",").join(value)  # as typed: --adam_betas 0.9 0.95 / "0.9,0.95"
    return repr(value)


def render_problems(problems: Sequence[Problem], subject: str = "StrategyConfig") -> str:
    """Numbered text: each problem's field, value and source, what is wrong, the fix."""
    count = len(problems)
    lines = [f"error: invalid {subject} ({count} problem{'s' if count != 1 else ''})"]
    for number, problem in enumerate(problems, 1):
        indent = " " * (len(str(number)) + 4)
        if problem.field is None:
            lines.append(f"  {number}. {problem.message}")
        else:
            where = f" (from {problem.source})" if problem.source else ""
            value = display(problem.value, problem.source)
            lines.append(f"  {number}. {problem.field} = {value}{where}")
            lines.append(f"{indent}problem: {problem.message}")
        if problem.fix:
            lines.append(f"{indent}fix: {problem.fix}")
    return "\n".join(lines)


def headline(config: StrategyConfig) -> str:
    """One line: the backend, engine, device and precision in force."""
    return (
        f"StrategyConfig: backend {config.resolved_backend}, engine_type "
        f"{config.engine_type}, device {config.device}, precision {config.resolved_precision}"
    )


def _table(rows: Sequence[tuple[str, str, str]]) -> str:
    header = ("field", "value", "source")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(2)]
    return "\n".join(
        f"{name:<{widths[0]}}  {value:<{widths[1]}}  {source}".rstrip()
        for name, value, source in [header, *rows]
    )


def _json_payload(resolved: Resolved) -> dict[str, Any]:
    config = resolved.config
    if config is None:
        return {"valid": False, "problems": [p.as_dict() for p in resolved.problems]}
    dumped = config.model_dump(mode="json")
    fields = {
        name: {
            "value": dumped[name],
            "source": resolved.source(name),
            "default": info.get_default(call_default_factory=True),
        }
        for name, info in StrategyConfig.model_fields.items()
        if name != "extra_args"
    }
    extra = {
        name: {"value": value, "source": resolved.origin.get(name)}
        for name, value in sorted(config.extra_args.items())
    }
    return {
        "valid": True,
        "resolved": {
            "backend": config.resolved_backend,
            "precision": config.resolved_precision,
            "sleep_level": config.sleep_level,
        },
        "fields": fields,
        "extra_args": extra,
    }


def _dump(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, indent=2, default=str)


def _fail(ctx: click.Context, resolved: Resolved, as_json: bool) -> NoReturn:
    """Report ``resolved``'s problems (JSON on stdout, else text on stderr); exit 1."""
    if as_json:
        click.echo(_dump(_json_payload(resolved)))
    else:
        click.echo(render_problems(resolved.problems), err=True)
    ctx.exit(1)


# -- commands --------------------------------------------------------------------------
class PassThroughCommand(click.Command):
    """A command that hands the options it does not define to ``StrategyConfig``; its
    help lists them."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        names = " ".join(
            f"--{name}" for name in StrategyConfig.model_fields if name != "extra_args"
        )
        with formatter.section("StrategyConfig flags"):
            formatter.write_text(
                "Every field is a flag, as in a trainer's command line: --zero_stage 3 "
                "(or --zero-stage 3), --adam_betas 0.9 0.95, and for a boolean --bf16 or "
                "--no-bf16. Flags win over LIGHTRFT_* environment variables, which win over "
                "the --config file. `lightrft config schema` describes each field."
            )
            formatter.write_paragraph()
            formatter.write_text(names)


def config_file_option(function: _F) -> _F:
    """The ``--config FILE`` option (YAML or JSON), read by lightrft.config."""
    return click.option(
        "--config",
        "config_file",
        metavar="FILE",
        default=None,
        help="YAML (.yaml/.yml) or JSON config file: the lowest layer above the defaults.",
    )(function)


@click.group()
def config() -> None:
    """Show, validate or describe (JSON Schema) a StrategyConfig.

    The configuration is layered as trainers layer it: defaults < --config FILE <
    LIGHTRFT_* environment variables < flags.
    """


@config.command(
    cls=PassThroughCommand, context_settings=PASS_THROUGH, short_help="Each value and its source."
)
@config_file_option
@click.option("--all", "show_all", is_flag=True, help="List every field, defaults included.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: every value and its source.")
@click.pass_context
def show(ctx: click.Context, config_file: str | None, show_all: bool, as_json: bool) -> None:
    """Print each value and the source that set it: a file, an environment variable,
    a flag, or the default (only the values not left at their defaults, unless --all).

    Exits 1, listing every problem, when the configuration is invalid.
    """
    resolved = resolve(config_file, ctx.args)
    config = resolved.config
    if config is None:
        _fail(ctx, resolved, as_json)
    if as_json:
        click.echo(_dump(_json_payload(resolved)))
        return
    names = [name for name in StrategyConfig.model_fields if name != "extra_args"]
    shown = [n for n in names if show_all or resolved.source(n) != DEFAULT]
    rows = [(n, repr(getattr(config, n)), resolved.source(n)) for n in shown]
    rows += [
        (f"extra_args.{name}", repr(value), resolved.origin.get(name, "?"))
        for name, value in sorted(config.extra_args.items())
    ]
    click.echo(headline(config))
    if rows:
        click.echo(_table(rows))
    hidden = len(names) - len(shown)
    if hidden:
        which = "every field is" if not rows else f"the other {hidden} fields are"
        click.echo(f"({which} at the default; --all lists them)")


@config.command(
    cls=PassThroughCommand,
    context_settings=PASS_THROUGH,
    short_help="Every problem at once: field, value, source, fix.",
)
@config_file_option
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="Also check the sizes that depend on the number of ranks (batch sizes, sp_size, "
    "engine_tp_size, ...).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Also refuse names that are not fields (kept in extra_args otherwise), such as a "
    "misspelt zero_stag.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON: valid, and the problems.")
@click.pass_context
def validate(
    ctx: click.Context,
    config_file: str | None,
    world_size: int | None,
    strict: bool,
    as_json: bool,
) -> None:
    """Check a configuration and report every problem at once: the field, its value,
    where the value came from and how to fix it.

    Exits 0 when valid, 1 when not (2 for a usage error such as an unknown flag).
    """
    resolved = resolve(config_file, ctx.args)
    config = resolved.config
    if config is None:
        _fail(ctx, resolved, as_json)
    problems = unknown_names(resolved) if strict else []
    steps = None
    if world_size is not None:
        try:
            steps = config.gradient_accumulation_steps(world_size)
        except ConfigError as exc:
            problems += [explain(p, resolved.values, resolved.origin) for p in exc.problems]
    if problems:
        _fail(ctx, Resolved(None, resolved.values, resolved.origin, problems), as_json)
    if as_json:
        click.echo(_dump({"valid": True, "problems": []}))
        return
    click.echo(f"valid: {headline(config)}")
    if steps is not None:
        click.echo(f"at world size {world_size}: {steps} gradient accumulation step(s)")


@config.command(short_help="The JSON Schema of StrategyConfig.")
def schema() -> None:
    """Print the JSON Schema of StrategyConfig (types, bounds, defaults, descriptions)."""
    click.echo(json.dumps(StrategyConfig.json_schema(), indent=2))
