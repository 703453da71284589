"""Near-miss detection: the fast one-edit check agrees with the full distance."""

from __future__ import annotations

import itertools
import random

from lightrft.config.spelling import closest, edit_distance, is_one_edit, one_edit_away


def test_edit_distance_counts_each_kind_of_edit_once() -> None:
    assert edit_distance("zero_stage", "zero_stage") == 0
    assert edit_distance("zero_stag", "zero_stage") == 1  # insertion
    assert edit_distance("zero_stagee", "zero_stage") == 1  # deletion
    assert edit_distance("zero_stoge", "zero_stage") == 1  # substitution
    assert edit_distance("zreo_stage", "zero_stage") == 1  # adjacent swap
    assert edit_distance("zero_stg", "zero_stage") == 2


def test_is_one_edit_matches_edit_distance_on_random_words() -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("ab_") for _ in range(rng.randint(0, 6))) for _ in range(300)]
    for a, b in itertools.product(words[:60], words):
        assert is_one_edit(a, b) == (edit_distance(a, b) == 1), (a, b)


def test_one_edit_away_ignores_very_short_names() -> None:
    assert one_edit_away("l3", ["l2"]) is None
    assert one_edit_away("sed", ["seed"]) == "seed"


def test_closest_is_case_insensitive_and_bounded() -> None:
    assert closest("VLM", ["vllm", "sglang", "hf"]) == "vllm"
    assert closest("megatron", ["vllm", "sglang", "hf"]) is None


def test_one_edit_away_finds_exactly_the_brute_force_answer() -> None:
    rng = random.Random(1)
    fields = sorted(
        {"".join(rng.choice("abc_") for _ in range(rng.randint(3, 7))) for _ in range(80)}
    )
    for _ in range(2000):
        name = "".join(rng.choice("abc_") for _ in range(rng.randint(3, 7)))
        brute = sorted(f for f in fields if edit_distance(name, f) == 1)
        assert one_edit_away(name, fields) == (brute[0] if brute else None), name
