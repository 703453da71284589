"""``python -m lightrft.strategy.cli``: the ``lightrft`` command."""

from lightrft.strategy.cli import main

raise SystemExit(main())
