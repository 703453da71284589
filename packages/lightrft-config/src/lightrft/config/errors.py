"""Configuration errors that name the field, the bad value, where it came from and
what is accepted instead."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from lightrft.config.spelling import closest


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration.

    Attributes:
        field: the field's name (for a rule joining several fields, the one to change
            first), or ``None`` when no field is at fault (an unreadable file).
        value: the offending value as it was given.
        message: what is wrong.
        accepted: what the field accepts, when that can be said in a few words.
        source: where the value came from (``"environment variable LIGHTRFT_SEED"``,
            ``"file cfg.yaml"``, ``"command line --seed"``), when known.
        fix: what to do, for a rule joining several fields (``"set train_batch_size
            to 8 or 12, or change micro_train_batch_size"``); the message then reads on
            from the field (``"is not a multiple of micro_train_batch_size=4"``).
    """

    field: str | None
    value: Any
    message: str
    accepted: str | None = None
    source: str | None = None
    fix: str | None = None

    def __str__(self) -> str:
        if self.field is None:
            return self.message
        where = f" (from {self.source})" if self.source else ""
        if self.fix is not None:  # a rule joining fields: "a=1 contradicts b=2; fix"
            return f"{self.field}={self.value!r}{where} {self.message}; {self.fix}"
        text = f"{self.field}={self.value!r}{where}: {self.message}"
        if self.accepted:
            text += f"; accepted: {self.accepted}"
        return text


class ConfigError(ValueError):
    """A configuration could not be built. ``problems`` lists every reason found."""

    def __init__(self, problems: list[ConfigProblem], subject: str = "StrategyConfig") -> None:
        self.problems = problems
        self.subject = subject
        count = len(problems)
        header = f"invalid {subject} ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([header, *(f"  - {p}" for p in problems)]))

    def with_sources(self, sources: Mapping[str, str]) -> ConfigError:
        """A copy whose problems say where each field's value came from."""
        return ConfigError(
            [
                replace(p, source=sources[p.field])
                if p.field is not None and p.field in sources
                else p
                for p in self.problems
            ],
            self.subject,
        )


def _bounds(metadata: list[Any]) -> str:
    parts: list[str] = []
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
    return " and ".join(parts)


def _describe_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in typing.get_args(annotation))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if annotation is type(None):
        return "null"
    if annotation in names:
        return names[annotation]
    if origin is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def describe_accepted(info: FieldInfo) -> str:
    """A short human description of what a field accepts, derived from its type and
    constraints (or from an explicit ``json_schema_extra={"accepted": ...}``)."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("accepted"), str):
        return str(extra["accepted"])
    text = _describe_type(info.annotation)
    bounds = _bounds(info.metadata)
    return f"{text} {bounds}" if bounds else text


def _lower_first(message: str) -> str:
    return message[:1].lower() + message[1:] if message else message


def from_validation_error(
    exc: ValidationError,
    model: type[BaseModel],
    inputs: Mapping[str, Any] | None = None,
    sources: Mapping[str, str] | None = None,
) -> ConfigError:
    """Turn pydantic's error into a :class:`ConfigError` with one problem per field.

    ``inputs`` are the raw values that were validated (used to show a whole value when
    pydantic reports one element of it); ``sources`` maps a field name to where its
    value came from.
    """
    inputs = inputs or {}
    sources = sources or {}
    fields = model.model_fields
    problems: list[ConfigProblem] = []
    seen: set[str] = set()
    for err in exc.errors(include_url=False):
        loc = err.get("loc", ())
        name = str(loc[0]) if loc else None
        if name is None or err["type"].startswith("lightrft_"):
            items = (err.get("ctx") or {}).get("items") or [err["msg"]]
            for item in items:  # structured from the validator on; a bare text has no field
                if not isinstance(item, ConfigProblem):
                    item = ConfigProblem(None, None, str(item))
                elif item.field is not None and item.source is None and item.field in sources:
                    item = replace(item, source=sources[item.field])
                problems.append(item)
            continue
        if name in seen:  # one problem per field: unions report each branch
            continue
        seen.add(name)
        value = inputs.get(name, err.get("input"))
        source = sources.get(name)
        if err["type"] == "extra_forbidden":
            guess = closest(name, fields)
            hint = f"; did you mean {guess!r}?" if guess else ""
            problems.append(
                ConfigProblem(
                    name,
                    value,
                    f"unknown field{hint} (StrategyConfig.from_args keeps unknown names "
                    "in extra_args instead)",
                    source=source,
                )
            )
            continue
        info = fields.get(name)
        message = _lower_first(err["msg"])
        if info is not None and isinstance(value, str):
            choices = [str(c) for c in typing.get_args(info.annotation)]
            guess = (
                closest(value, choices) if typing.get_origin(info.annotation) is Literal else None
            )
            if guess and guess != value:
                message += f" (did you mean {guess!r}?)"
        accepted = describe_accepted(info) if info is not None else None
        problems.append(ConfigProblem(name, value, message, accepted, source))
    return ConfigError(problems, subject=model.__name__)
