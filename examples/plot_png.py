"""A line plot of reward and KL per step as a PNG, with the standard library only."""

from __future__ import annotations

import itertools
import struct
import zlib
from pathlib import Path
from typing import Any

WIDTH, HEIGHT, MARGIN = 480, 240, 20
COLOURS = {"reward_mean": (31, 119, 180), "kl": (214, 39, 40)}


def _png(pixels: list[bytearray]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    )  # fmt: skip


def plot_metrics(rows: list[dict[str, Any]], path: Path) -> None:
    """Reward (blue, 0..1) and KL (red, scaled to its own maximum) against the step,
    on a white canvas with a grey frame; written to ``path``."""
    pixels = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(HEIGHT)]

    def put(x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < WIDTH and 0 <= y < HEIGHT:
            pixels[y][3 * x : 3 * x + 3] = bytes(colour)

    for x in range(MARGIN, WIDTH - MARGIN):
        put(x, MARGIN, (200, 200, 200))
        put(x, HEIGHT - MARGIN, (200, 200, 200))
    for y in range(MARGIN, HEIGHT - MARGIN + 1):
        put(MARGIN, y, (200, 200, 200))
        put(WIDTH - MARGIN, y, (200, 200, 200))
    steps = [r["step"] for r in rows]
    if not steps:
        path.write_bytes(_png(pixels))
        return
    lo, hi = min(steps), max(steps)
    for key, colour in COLOURS.items():
        values = [float(r[key]) for r in rows]
        top = 1.0 if key == "reward_mean" else max(max(values), 1e-12)
        points = [
            (
                MARGIN + round((s - lo) / max(hi - lo, 1) * (WIDTH - 2 * MARGIN)),
                HEIGHT - MARGIN - round(min(v / top, 1.0) * (HEIGHT - 2 * MARGIN)),
            )
            for s, v in zip(steps, values, strict=True)
        ]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            n = max(abs(x1 - x0), abs(y1 - y0), 1)
            for i in range(n + 1):
                x, y = x0 + (x1 - x0) * i // n, y0 + (y1 - y0) * i // n
                for dy in (-1, 0, 1):
                    put(x, y + dy, colour)
    path.write_bytes(_png(pixels))
