#!/usr/bin/env python3
"""The project's commands, on a fresh clone with nothing but Python (>= 3.10).

    python3 dev.py demo              # main job: a small end-to-end training run on CPU
    python3 dev.py test              # the whole test suite, as CI runs it
    python3 dev.py nox -s config-3.12 -- -k from_args    # any nox session

On first use it creates .tools/, a virtual environment holding pinned uv and nox;
nox then builds each session's environment from uv.lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TOOLS = ROOT / ".tools"
REQUIREMENTS = ["uv==0.13.8", "nox==2026.10.20"]
BIN = TOOLS / ("Scripts" if os.name == "nt" else "bin")
COMMANDS = {"demo": ["-s", "demo"], "test": [], "nox": None}


def ensure_tools() -> None:
    stamp = TOOLS / "requirements.txt"
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted and (BIN / "nox").exists():
        return
    print(f"dev.py: installing {' '.join(REQUIREMENTS)} into {TOOLS}", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=True).create(TOOLS)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS], check=True)
    stamp.write_text(wanted)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_tools()
    os.environ["PATH"] = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
    nox_args = rest if command == "nox" else [*(COMMANDS[command] or []), *rest]
    nox = [str(BIN / "nox"), "--noxfile", str(ROOT / "noxfile.py"), *nox_args]
    return subprocess.run(nox, cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
