"""Writing a command's output directory all at once: into a staging directory beside
it, renamed into place only when complete, so a killed export or conversion leaves no
half-written output (and an existing output is replaced only with ``force``)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightrft.strategy.checkpoint.layout import CheckpointError


class OutputExistsError(CheckpointError, FileExistsError):
    """The output directory exists and is not empty, and ``force`` was not given."""


def check_output(out: Path, *, force: bool, source: Path | None = None) -> None:
    """Refuse a non-empty ``out`` without ``force``, and an ``out`` that is ``source`` or
    holds it (replacing it would delete the source), before any work is done."""
    if source is not None:
        resolved, src = out.resolve(), source.resolve()
        if resolved == src or resolved in src.parents or src in resolved.parents:
            raise OutputExistsError(
                f"OUT {out} is, holds or lies inside the source checkpoint {source}; write to "
                "a directory outside it"
            )
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is a file; choose a directory path for OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExistsError(
            f"{out} exists and is not empty; choose another OUT, or pass --force to replace it "
            "(its contents are removed only once the new output is complete)"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_staging(out: Path) -> None:
    """Staging directories of ``out`` left by killed runs (their process is gone)."""
    for staging in out.parent.glob(f".{out.name}.partial-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_output(out: Path, *, force: bool, source: Path | None = None) -> Iterator[Path]:
    """Yield a fresh staging directory next to ``out``; on success it becomes ``out``
    (an existing ``out`` is set aside first and deleted last); on any error the
    staging directory is removed and ``out`` is untouched."""
    out = out.absolute()
    check_output(out, force=force, source=source)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = None
    if out.exists():
        retired = out.parent / f".{out.name}.retired-{time.time_ns()}"
        os.replace(out, retired)
    os.replace(staging, out)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
