"""stand_in: a class with another class's real signatures, which binds, records, delegates."""

from __future__ import annotations

from typing import Any

import pytest

from lightrft.testing.stand_in import stand_in


class Real:
    def __init__(self, path: str, *, size: int = 1, **options: Any) -> None:
        raise AssertionError("the real class is never run")

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None) -> None:
        raise AssertionError("the real class is never run")

    def flush(self) -> None:
        raise AssertionError("the real class is never run")

    @staticmethod
    def helper() -> None: ...


class Behaviour:
    def construct(self, obj: Any, path: str, size: int, **options: Any) -> None:
        obj.path, obj.size, obj.options = path, size, options

    def generate(self, obj: Any, input_ids: list[int], sampling_params: Any) -> list[int]:
        return [t + obj.size for t in input_ids]


def test_calls_bind_to_the_real_signatures_then_run_the_behaviour() -> None:
    fake_class = stand_in(Real, Behaviour(), methods=["generate", "flush"])
    fake = fake_class("m", size=2, seed=3)
    assert (fake.path, fake.size, fake.options) == ("m", 2, {"seed": 3})
    assert fake.generate([1, 2]) == [3, 4]
    assert fake.flush() is None  # no behaviour: None
    assert fake.calls == [
        ("__init__", {"path": "m", "size": 2, "options": {"seed": 3}}),
        ("generate", {"input_ids": [1, 2]}),
        ("flush", {}),
    ]


def test_a_call_the_real_class_would_refuse_raises_type_error_and_is_not_recorded() -> None:
    fake_class = stand_in(Real, Behaviour(), methods=["generate"])
    fake = fake_class("m")
    with pytest.raises(TypeError, match="unexpected keyword argument 'prompts'"):
        fake.generate([1], prompts=[1])
    with pytest.raises(TypeError, match="missing a required argument: 'path'"):
        fake_class(size=1)
    assert [name for name, _ in fake.calls] == ["__init__"]


def test_only_methods_the_real_class_has_can_be_copied() -> None:
    with pytest.raises(AttributeError, match="no_such_method"):
        stand_in(Real, Behaviour(), methods=["no_such_method"])
    with pytest.raises(TypeError, match="not an instance method"):
        stand_in(Real, Behaviour(), methods=["helper"])
