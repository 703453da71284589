"""The ``lightrft`` command: configuration, checkpoints and this machine.

    lightrft config show|validate|schema     what a configuration resolves to
    lightrft ckpt info|export|convert        what a checkpoint holds; HF export; backend moves
    lightrft doctor                          which backends and engines run here

Each group lives in its own module and is imported only when named, and none imports
torch at module level, so ``lightrft --help`` answers without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

#: command name -> "module:attribute" of its click command, imported on first use
COMMANDS = {
    "config": "lightrft.config.cli:config",
    "ckpt": "lightrft.strategy.cli.ckpt_cmd:ckpt",
    "doctor": "lightrft.strategy.cli.doctor_cmd:doctor",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported when they are invoked or listed."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module_name, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module_name), attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy[cmd_name]} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The short help of each group is kept here, so that --help imports nothing.
        rows = [(name, SUMMARIES.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


SUMMARIES = {
    "config": "Show, validate or describe (JSON Schema) a StrategyConfig.",
    "ckpt": "Inspect a checkpoint, export it to Hugging Face, convert between backends.",
    "doctor": "Which backends, engines and devices work here, and what to install.",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lightrft-strategy", prog_name="lightrft")
def cli() -> None:
    """LightRFT's command: configuration, checkpoints and this machine."""


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point; returns the exit status."""
    try:
        cli.main(args=argv, prog_name="lightrft", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0
