"""Near-miss detection for configuration names ("zero_stag" -> "zero_stage")."""

from __future__ import annotations

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


def one_edit_away(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate exactly one edit away from ``name``, if any.

    Names shorter than three characters are never matched: at that length almost
    everything is one edit from something.
    """
    if len(name) < 3:
        return None
    matches = sorted(c for c in candidates if len(c) >= 3 and edit_distance(name, c) == 1)
    return matches[0] if matches else None


def closest(name: str, candidates: Iterable[str], max_distance: int = 2) -> str | None:
    """The nearest candidate within ``max_distance`` edits (case-insensitive), if any."""
    best: tuple[int, str] | None = None
    for candidate in candidates:
        distance = edit_distance(name.lower(), candidate.lower())
        if distance <= max_distance and (best is None or (distance, candidate) < best):
            best = (distance, candidate)
    return best[1] if best else None
