"""``torchrun`` for the demo, ending in one line instead of a traceback.

    python examples/launch.py --nproc-per-node 2 examples/grpo.py [flags]

The arguments are torchrun's (``torch.distributed.run``). When every rank exits 0 so
does this. When a rank fails, torchrun raises ``ChildFailedError``, whose traceback
reads as a crash of the launcher even when the job exited on purpose (the demo's exit 1
below ``--min-gain``); here it becomes one line naming each failed rank and its exit
status, and the exit status is the job's.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def launch(argv: list[str]) -> int:
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        named = ", ".join(f"rank {rank} exited {code}" for rank, code in codes.items())
        print(f"launch: {named} (the lines above say why)", file=sys.stderr)
        positive = [code for code in codes.values() if code > 0]
        return max(positive) if positive else 1  # a signal (negative): 1
    return 0


if __name__ == "__main__":
    raise SystemExit(launch(sys.argv[1:]))
