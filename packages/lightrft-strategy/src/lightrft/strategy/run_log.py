"""What a training run writes for the people reading it: one JSON line per step
(``metrics.jsonl``), TensorBoard scalars (the config's ``use_tensorboard``), a progress
bar (tqdm) and a plot of every logged quantity (matplotlib).

Only rank 0 writes or draws; on other ranks :class:`RunLog` does nothing, so a trainer
calls it on every rank. It needs the ``tracking`` extra
(``pip install 'lightrft-strategy[tracking]'``: tensorboard, matplotlib, tqdm).

    log = RunLog(out, rank=strategy.get_rank(), steps=200, tensorboard=config.use_tensorboard)
    for step in range(1, 201):
        ...
        log.log(step, {"reward": r, "kl": kl})
    log.close()
    plot_metrics(read_metrics(out / "metrics.jsonl"), out / "plot.png", PANELS)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "plot_metrics", "read_metrics"]

_EXTRA = "pip install 'lightrft-strategy[tracking]'"


def _missing(exc: ImportError) -> ImportError:
    return ImportError(f"{exc.name or exc} is needed for the run log: {_EXTRA}")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunLog:
    """Rank 0's record of a run under ``out``: ``metrics.jsonl``, TensorBoard event files
    (``tensorboard``: False, True for ``out/tensorboard``, or a directory, as upstream's
    trainers take ``--use_tensorboard PATH``) and a tqdm bar over ``steps`` steps.

    ``first`` is the first step this process runs: on a resumed run (``first > 1``) the
    lines and TensorBoard points of steps ``>= first`` left by the interrupted run are
    dropped, so every step appears once.
    """

    def __init__(
        self,
        out: Path,
        *,
        rank: int,
        steps: int,
        first: int = 1,
        tensorboard: bool | str = False,
        description: str = "train",
    ) -> None:
        self.active = rank == 0
        self._done = first - 1
        self.path = out / "metrics.jsonl"
        self.samples_path = out / "samples.jsonl"
        self.tensorboard_dir: Path | None = None
        self._writer: Any = None
        try:
            from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
        except ImportError as exc:
            raise _missing(exc) from exc
        self._bar = tqdm(total=steps, initial=first - 1, desc=description,
                         disable=not self.active, dynamic_ncols=True)  # fmt: skip
        if not self.active:
            return
        out.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path):
            kept = []
            if first > 1 and path.exists():
                kept = [row for row in read_metrics(path) if row.get("step", 0) < first]
            path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        if tensorboard:
            self.tensorboard_dir = (
                out / "tensorboard" if tensorboard is True else Path(str(tensorboard))
            )
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # torch's writer needs the tensorboard package
                raise _missing(exc) from exc
            # purge_step: points a resumed run rewrites are hidden from the interrupted one
            purge = first if first > 1 else None
            self._writer = SummaryWriter(str(self.tensorboard_dir), purge_step=purge)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """Append ``row`` (with ``step``) to ``metrics.jsonl``, write its numbers to
        TensorBoard under their keys and advance the bar; a no-op off rank 0."""
        if not self.active:
            return
        record = {"step": step, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: float(v) for k, v in row.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        if self._writer is not None:
            for key, value in numbers.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        shown = {k: f"{numbers[k]:.3g}" for k in list(numbers)[:4]}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(max(0, step - self._done))  # a step-0 row (before training) adds none
        self._done = max(self._done, step)

    def log_samples(
        self, step: int, samples: Sequence[Mapping[str, Any]], *, kind: str = "rollout"
    ) -> None:
        """Append ``samples`` (each a mapping such as ``prompt``, ``completion``,
        ``answer``, ``reward``) to ``samples.jsonl``, one object per sample with ``step``
        and ``kind``, and show them in TensorBoard's text panel under ``samples/<kind>``;
        a no-op off rank 0."""
        if not self.active or not samples:
            return
        with self.samples_path.open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, "kind": kind, **sample}) + "\n")
        if self._writer is not None:
            self._writer.add_text(f"samples/{kind}", _markdown_table(samples), step)
            self._writer.flush()

    def write(self, message: str) -> None:
        """A line above the bar (rank 0 only)."""
        if self.active:
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _markdown_table(samples: Sequence[Mapping[str, Any]]) -> str:
    """Samples as a Markdown table (TensorBoard's text panel renders Markdown)."""
    keys = list(dict.fromkeys(k for s in samples for k in s))

    def cell(value: Any) -> str:
        return " ".join(str(value).split()).replace("|", "\\|")

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(s.get(k, "")) for k in keys) + " |" for s in samples]
    return "\n".join(lines)


def plot_metrics(
    rows: Sequence[Mapping[str, Any]],
    path: Path,
    panels: Mapping[str, Sequence[str]],
    *,
    title: str | None = None,
    log_scale: Sequence[str] = (),
) -> Path:
    """One panel per kind of quantity: ``panels`` maps a panel's y-axis label (with its
    unit) to the metric keys drawn in it, against ``step``. Keys absent from every row
    are left out. A metric logged at every step of its span (a phase's) is a line; one
    logged on under half of the steps between its first and last point (an evaluation
    every few steps) is drawn as markers alone, since a line between evaluations would
    suggest a trend nobody measured. Panels named in
    ``log_scale`` get a logarithmic y axis (non-positive values are left out there)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise _missing(exc) from exc
    shown = {
        label: [k for k in keys if any(k in r for r in rows)] for label, keys in panels.items()
    }
    shown = {label: keys for label, keys in shown.items() if keys}
    columns = 2 if len(shown) > 1 else 1
    lines = max(1, math.ceil(len(shown) / columns))
    figure, axes = pyplot.subplots(lines, columns, figsize=(6 * columns, 3 * lines),
                                   squeeze=False, sharex=True)  # fmt: skip
    for ax, (label, keys) in zip(axes.flat, shown.items(), strict=False):
        log = label in log_scale
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
            points = [(s, v) for s, v in points if v > 0] if log else points
            if not points:
                continue
            sparse = len(points) < (points[-1][0] - points[0][0] + 1) / 2
            style = {"linestyle": "none", "marker": "D"} if sparse else {}
            ax.plot(*zip(*points, strict=True), label=key, **style)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
