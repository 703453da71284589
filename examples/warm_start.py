"""The warm-up's model for tests: ``grpo.py --sft-steps 150 --steps 0`` on the fake
strategy and engine (one process, about a minute on 2 cores), run once per checkout
and content of the job's files and the packages' sources, then reused by every test
session.

Tests start RL from it (``--pretrain``, ``--sft-steps 0``), so each strategy and engine
combination spends its time on RL, not on repeating the same warm-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SFT_STEPS = 150
_JOB = ("grpo.py", "arithmetic.py", "prompting.py", "grpo.yaml")


def _digest() -> str:
    """Of the job's files and every package's source: a warm-up made by other code (a
    changed strategy or fake engine) is not reused."""
    files = [HERE / f for f in _JOB]
    files += sorted((HERE.parent / "packages").glob("*/src/**/*.py"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def warm_model(cache: Path | None = None) -> Path:
    """The directory of the warm-up's model (Hugging Face format, with its tokenizer),
    trained now unless a run of the same job files left it in ``cache``."""
    digest = _digest()
    cache = cache or HERE.parent / ".cache" / "warm-model"
    done = cache / digest
    if (done / "sft_model" / "config.json").is_file():
        return done / "sft_model"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache, prefix="tmp-"))
    subprocess.run(
        [sys.executable, str(HERE / "grpo.py"), "--backend", "fake", "--engine_type", "fake",
         "--sft-steps", str(SFT_STEPS), "--steps", "0", "--out", str(work)],
        check=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    accuracy = {r["step"]: r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r}
    if not accuracy[0] < 0.05 < 0.2 < accuracy[SFT_STEPS]:  # learned, partly
        raise AssertionError(f"the warm-up did not learn as it should: {accuracy}")
    try:
        work.rename(done)
    except OSError:  # another session finished the same warm-up first: use that one
        shutil.rmtree(work, ignore_errors=True)
    return done / "sft_model"
