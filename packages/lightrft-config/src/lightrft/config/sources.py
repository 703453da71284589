"""Where configuration values come from: objects, files, the environment and argv.

Every reader returns plain values plus, per name, a note of where it came from, so a
validation error can say "environment variable LIGHTRFT_ZERO_STAGE" rather than just
"zero_stage".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lightrft.config.errors import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from lightrft.config.strategy_config import StrategyConfig

logger = logging.getLogger("lightrft.config")

Layer = tuple[dict[str, Any], dict[str, str]]
"""Values and, for each name, a description of where it came from."""


def as_mapping(obj: Any) -> dict[str, Any]:
    """The public attributes of a namespace, mapping, dataclass, model or plain object."""
    if obj is None:
        return {}
    if isinstance(obj, BaseModel):
        return {name: getattr(obj, name) for name in type(obj).model_fields}
    if isinstance(obj, Mapping):
        return {str(k): v for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    slots = getattr(type(obj), "__slots__", None)
    if slots:
        names = [slots] if isinstance(slots, str) else list(slots)
        return {n: getattr(obj, n) for n in names if not n.startswith("_") and hasattr(obj, n)}
    raise TypeError(
        f"StrategyConfig.from_args expects an argparse.Namespace, a mapping, an object with "
        f"attributes or a StrategyConfig, got {type(obj).__name__}: {obj!r}"
    )


def is_nullable(info: FieldInfo) -> bool:
    """Whether ``None`` is a valid value of the field."""
    return type(None) in typing.get_args(info.annotation)


def _non_null(annotation: Any) -> Any:
    """``annotation`` without ``| None`` and without ``Annotated[...]`` metadata."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, type(int | None)) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


# -- files -----------------------------------------------------------------------------
def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a YAML or JSON file; a :class:`ConfigError` says what is wrong."""
    p = Path(path)

    def fail(message: str) -> ConfigError:
        return ConfigError([ConfigProblem(None, None, f"config file {str(p)!r}: {message}")])

    if not p.is_file():
        raise fail("no such file" if not p.exists() else "not a regular file")
    suffix = p.suffix.lower()
    text = p.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise fail(
                f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise fail(
                "reading YAML needs PyYAML: pip install 'lightrft-config[yaml]' (or use JSON)"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise fail(f"not valid YAML: {problem}{where}") from None
    else:
        raise fail(f"unsupported extension {suffix or '(none)'!r}; use .yaml, .yml or .json")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise fail(f"must hold a mapping of field names to values, found {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


# -- environment -----------------------------------------------------------------------
def parse_text(name: str, info: FieldInfo, raw: str, source: str) -> Any:
    """A field's value from text (an environment variable); pydantic converts the rest."""
    text = raw.strip()
    if is_nullable(info) and text.lower() in ("", "none", "null"):
        return None
    base = _non_null(info.annotation)
    origin = typing.get_origin(base)
    if origin in (tuple, list):
        if text.startswith("["):
            return _json(name, raw, source, "a JSON list such as [0.9, 0.95]")
        return [part.strip() for part in text.split(",")]
    if origin is dict or base is dict:
        return _json(name, raw, source, 'a JSON object such as {"key": 1}')
    return text


def _json(name: str, raw: str, source: str, accepted: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [ConfigProblem(name, raw, f"not valid JSON ({exc.msg})", accepted, source)]
        ) from None


def read_env(model: type[StrategyConfig], environ: Mapping[str, str]) -> Layer:
    """``<PREFIX><FIELD>`` variables (any case after the prefix), parsed per field."""
    prefix = model.ENV_PREFIX
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, raw in environ.items():
        if not key.upper().startswith(prefix) or len(key) == len(prefix):
            continue
        name = key[len(prefix) :].lower()
        source = f"environment variable {key}"
        info = model.model_fields.get(name)
        values[name] = raw if info is None else parse_text(name, info, raw, source)
        origin[name] = source
    return values, origin


# -- layering --------------------------------------------------------------------------
def collect_layers(
    model: type[StrategyConfig],
    *,
    file: str | os.PathLike[str] | None,
    environ: Mapping[str, str],
    args: Any,
) -> list[Layer]:
    """The file, environment and argument layers, lowest precedence first."""
    layers: list[Layer] = []
    if file is not None:
        data = read_file(file)
        layers.append((data, dict.fromkeys(data, f"file {os.fspath(file)}")))
    layers.append(read_env(model, environ))
    given = as_mapping(args)
    layers.append((given, {k: f"command line --{k}" for k in given}))
    return layers


def merge_layers(layers: list[Layer]) -> Layer:
    """Later layers win name by name; ``extra_args`` mappings merge key by key."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for layer_values, layer_origin in layers:
        for name, value in layer_values.items():
            if name == "extra_args" and isinstance(value, Mapping):
                values["extra_args"] = {**values.get("extra_args", {}), **value}
            else:
                values[name] = value
            if name in layer_origin:
                origin[name] = layer_origin[name]
    return values, origin


# -- argparse --------------------------------------------------------------------------
def _nullable(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _flag_spec(info: FieldInfo) -> dict[str, Any]:
    """argparse keyword arguments for one field, typed so the namespace holds real
    ints, floats and tuples for code that reads it directly."""
    annotation = info.annotation
    base = _non_null(annotation)
    nullable = is_nullable(info)
    wrap = _nullable if nullable else (lambda convert: convert)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if set(typing.get_args(annotation)) == {bool, str}:
        return {"nargs": "?", "const": True, "metavar": "PATH"}
    if typing.get_origin(base) is Literal:
        choices = list(typing.get_args(base))
        convert = type(choices[0])
        return {"type": wrap(convert), "choices": [*choices, None] if nullable else choices}
    if typing.get_origin(base) is tuple:
        n = len(typing.get_args(base))
        return {"nargs": n, "type": float, "metavar": tuple(f"V{i + 1}" for i in range(n))}
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        return {"nargs": "+", "type": item, "metavar": item.__name__.upper()}
    if {typing.get_origin(arg) or arg for arg in typing.get_args(base)} == {dict, str}:
        return {"type": wrap(str), "metavar": "JSON|PATH"}
    if base in (int, float, str):
        return {"type": wrap(base), "metavar": base.__name__.upper()}
    raise TypeError(f"no command-line form for field type {annotation!r}")


def add_arguments(
    model: type[StrategyConfig],
    parser: argparse.ArgumentParser,
    *,
    suppress_defaults: bool = False,
    shown_defaults: Mapping[str, Any] | None = None,
) -> argparse.ArgumentParser:
    """One flag per field; a flag the parser already defines is left as it is. Help
    shows ``shown_defaults[name]`` where given (the value a file or the environment
    sets), else the field's default."""
    group = parser.add_argument_group("strategy", "lightrft.config.StrategyConfig fields")
    for name, info in model.model_fields.items():
        if name == "extra_args":
            continue
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        default = argparse.SUPPRESS if suppress_defaults else info.default
        shown = shown_defaults[name] if shown_defaults and name in shown_defaults else info.default
        help_text = f"{info.description} (default: {shown!r})"
        try:
            group.add_argument(
                *flags, dest=name, default=default, help=help_text, **_flag_spec(info)
            )
        except argparse.ArgumentError:
            logger.debug("parser already defines a flag for %r; leaving it", name)
    return parser
