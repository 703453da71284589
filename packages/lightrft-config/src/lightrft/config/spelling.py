"""Near-miss detection for configuration names ("zero_stag" -> "zero_stage")."""

from __future__ import annotations

import functools
from collections.abc import Iterable


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and
    swaps of two adjacent characters each count as one edit."""
    rows, cols = len(a) + 1, len(b) + 1
    d = [[0] * cols for _ in range(rows)]
    for i in range(rows):
        d[i][0] = i
    for j in range(cols):
        d[0][j] = j
    for i in range(1, rows):
        for j in range(1, cols):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def is_one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by exactly one edit (as in :func:`edit_distance`),
    in linear time: this runs for every unknown name a trainer passes."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if len(a) < len(b):  # one insertion
        return a[i:] == b[i + 1 :]
    if a[i + 1 :] == b[i + 1 :]:  # one substitution
        return True
    return a[i + 2 :] == b[i + 2 :] and a[i : i + 2] == b[i : i + 2][::-1]  # adjacent swap


def _deletions(word: str) -> set[str]:
    return {word, *(word[:i] + word[i + 1 :] for i in range(len(word)))}


@functools.lru_cache(maxsize=16)
def _deletion_index(candidates: tuple[str, ...]) -> dict[str, frozenset[str]]:
    index: dict[str, set[str]] = {}
    for candidate in candidates:
        for key in _deletions(candidate):
            index.setdefault(key, set()).add(candidate)
    return {key: frozenset(found) for key, found in index.items()}


def one_edit_away(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate exactly one edit away from ``name``, if any.

    Names shorter than three characters are never matched: at that length almost
    everything is one edit from something. Two words one edit apart share a
    one-deletion variant, so an index of those finds the few candidates worth
    checking without comparing ``name`` to every field.
    """
    if len(name) < 3:
        return None
    index = _deletion_index(tuple(candidates))
    nearby: set[str] = set()
    for key in _deletions(name):
        nearby |= index.get(key, frozenset())
    swaps = {name[:i] + name[i + 1] + name[i] + name[i + 2 :] for i in range(len(name) - 1)}
    nearby |= {s for s in swaps if s in index and s in index[s]}
    matches = sorted(c for c in nearby if len(c) >= 3 and is_one_edit(name, c))
    return matches[0] if matches else None


def closest(name: str, candidates: Iterable[str], max_distance: int = 2) -> str | None:
    """The nearest candidate within ``max_distance`` edits (case-insensitive), if any."""
    best: tuple[int, str] | None = None
    for candidate in candidates:
        if abs(len(candidate) - len(name)) > max_distance:
            continue  # cannot be within reach; skip the quadratic comparison
        distance = edit_distance(name.lower(), candidate.lower())
        if distance <= max_distance and (best is None or (distance, candidate) < best):
            best = (distance, candidate)
    return best[1] if best else None
