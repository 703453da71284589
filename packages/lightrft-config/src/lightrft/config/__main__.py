"""``python -m lightrft.config``: print the JSON Schema, or the effective config.

    python -m lightrft.config schema
    python -m lightrft.config show [--config FILE] [--zero_stage 3 ...]

``show`` layers the file, ``LIGHTRFT_*`` environment variables and the flags exactly
as :meth:`StrategyConfig.from_argv` does, then prints the summary and the full JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from lightrft.config.errors import ConfigError
from lightrft.config.strategy_config import StrategyConfig


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else "help"
    if command == "schema":
        sys.stdout.write(json.dumps(StrategyConfig.json_schema(), indent=2) + "\n")
        return 0
    if command == "show":
        try:
            config = StrategyConfig.from_argv(args, prog="python -m lightrft.config show")
        except ConfigError as exc:
            sys.stderr.write(f"{exc}\n")
            return 2
        sys.stdout.write(config.summary() + "\n" + config.model_dump_json(indent=2) + "\n")
        return 0
    sys.stdout.write(__doc__ or "")
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
