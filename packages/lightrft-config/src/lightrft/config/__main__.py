"""``python -m lightrft.config show|validate|schema``: the ``lightrft config`` command
(:mod:`lightrft.config.cli`, the same click group and exit status; extra ``cli``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from lightrft.config.cli import config
    except ImportError as exc:
        if exc.name != "click":
            raise
        sys.stderr.write(
            "python -m lightrft.config needs click; install it with: "
            "pip install 'lightrft-config[cli]'\n"
        )
        return 1
    try:
        config.main(
            args=list(sys.argv[1:] if argv is None else argv), prog_name="python -m lightrft.config"
        )
    except SystemExit as exc:  # click's standalone mode ends with the exit status
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
