"""``lightrft ckpt``: what a checkpoint holds, its model as a Hugging Face directory,
and the same run's state under the other backend. Everything runs in this process on
CPU (a conversion to DeepSpeed launches DeepSpeed's writers on CPU ranks)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click


class _CheckpointCommandError(click.ClickException):
    exit_code = 1


@contextmanager
def _errors() -> Iterator[None]:
    """Our checkpoint errors (and bad values) as one clear line and exit status 1."""
    from lightrft.strategy.checkpoint.layout import CheckpointError

    try:
        yield
    except (CheckpointError, ValueError, OSError) as exc:
        raise _CheckpointCommandError(f"{type(exc).__name__}: {exc}") from exc


@contextmanager
def _progress(label: str, enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A click progress bar fed by ``progress(stage, done, total)`` callbacks."""
    if not enabled:
        yield None
        return
    bars: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = click.progressbar(
                length=total, label=f"{label}: {stage}", file=sys.stderr
            )
            bar.__enter__()
        bar.update(done - bar.pos)

    try:
        yield update
    finally:
        for bar in bars.values():
            bar.__exit__(None, None, None)


@click.group()
def ckpt() -> None:
    """Inspect a checkpoint, export it to Hugging Face, convert between backends."""


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


@ckpt.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
def info(directory: Path, as_json: bool) -> None:
    """What DIRECTORY (a save_dir, or one tag directory in it) holds."""
    from lightrft.strategy.checkpoint.tools.describe import describe

    with _errors():
        found = describe(directory)
    if as_json:
        click.echo(json.dumps(found, indent=2, sort_keys=True))
        return
    click.echo(f"save_dir: {found['save_dir']}")
    latest = found["latest"]
    if latest is None:
        click.echo("latest:   (no 'latest' file)")
    else:
        state = "complete" if found["latest_complete"] else "NOT a complete checkpoint"
        click.echo(f"latest:   {latest} ({state})")
    for entry in found["tags"]:
        click.echo("")
        if not entry["complete"]:
            click.echo(f"{entry['tag']}: INCOMPLETE - {entry['problem']}")
            continue
        click.echo(
            f"{entry['tag']}: complete, step {entry['global_step']}, {_size(entry['size_bytes'])}"
        )
        click.echo(
            f"  backend:    {entry['backend']}, world size {entry['world_size']}"
            + (f", ZeRO stage {entry['zero_stage']}" if "zero_stage" in entry else "")
        )
        click.echo(f"  layout:     {entry.get('layout', '-')}")
        if "model_class" in entry:
            click.echo(
                f"  model:      {entry['model_class']}, {entry['parameters']} parameters "
                f"({entry['numel']:,} values, {'/'.join(entry['dtypes'])})"
            )
        click.echo(
            f"  optimizer:  {entry['optimizer'] if entry['has_optimizer'] else 'none'}"
            f"; scheduler: {'yes' if entry['has_scheduler'] else 'no'}"
            f"; HF config: {'yes' if entry['hf_config'] else 'no'}"
            f"; tokenizer: {'yes' if entry.get('tokenizer') else 'no'}"
        )
    for name in found["interrupted_saves"]:
        click.echo(f"\n.{name}.partial: an interrupted save (ignored by load_ckpt)")


@ckpt.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--to", "target", type=click.Choice(["hf"]), required=True, help="The format to export to."
)
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--tag", help="The tag to export (default: the one 'latest' names).")
@click.option(
    "--hf-config",
    type=click.Path(exists=True, path_type=Path),
    help="A model directory or config.json, when the checkpoint records none.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="Cast the weights (default: as the checkpoint holds them, as save_model writes them).",
)
@click.option(
    "--merge-lora",
    is_flag=True,
    help="A LoRA checkpoint: export the merged model (default: the adapter, in peft's format).",
)
@click.option(
    "--tokenizer",
    "tokenizer",
    type=click.Path(path_type=Path),
    help="A directory holding the tokenizer to write beside the weights: its tokenizer "
    "files are copied once transformers' AutoTokenizer loads it (default: the tokenizer "
    "save_ckpt recorded, if any).",
)
@click.option("--force", is_flag=True, help="Replace a non-empty OUT.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars.")
def export(
    directory: Path,
    target: str,
    out: Path,
    tag: str | None,
    hf_config: Path | None,
    dtype: str | None,
    merge_lora: bool,
    tokenizer: Path | None,
    force: bool,
    progress: bool,
) -> None:
    """Export the model of DIRECTORY's checkpoint to OUT as a Hugging Face model
    directory (safetensors, config.json and the tokenizer's files), on CPU, at any world
    size it was saved at. A LoRA checkpoint exports its adapter (peft's format), or
    merged with --merge-lora."""
    from lightrft.strategy.checkpoint.tools.export import export_hf
    from lightrft.strategy.checkpoint.tools.offline import open_checkpoint

    with _errors(), _progress("export", progress) as update:
        source = open_checkpoint(directory, tag)
        report = export_hf(
            source, out, hf_config=hf_config, dtype=dtype, force=force, progress=update,
            merge_lora=merge_lora, tokenizer=tokenizer,
        )  # fmt: skip
    click.echo(
        f"exported {source.path} ({source.metadata.get('backend')}, step "
        f"{source.metadata.get('global_step')}) to {report.output}: {report.tensors} "
        f"tensors, {_size(report.bytes)} in {len(report.files)} file(s); "
        f"{report.verification.summary()}"
        + (f"; tokenizer from {report.tokenizer}" if report.tokenizer is not None else "")
    )
    if report.tokenizer is None:
        click.echo(
            f"note: no tokenizer was written ({source.path} records none); add one with "
            "--tokenizer DIR (a directory holding the run's tokenizer), or save "
            "checkpoints with save_ckpt(..., tokenizer=tokenizer)",
            err=True,
        )


@ckpt.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "target",
    type=click.Choice(["fsdp2", "deepspeed"]),
    required=True,
    help="The backend to convert to.",
)
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--tag", help="The tag to convert (default: the one 'latest' names).")
@click.option("--zero-stage", type=int, help="The target ZeRO stage (--to deepspeed).")
@click.option(
    "--world-size", type=int, help="The world size the target resumes at (default: the source's)."
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="The DeepSpeed run's precision (--to deepspeed; default: the source's, else fp32).",
)
@click.option(
    "--drop",
    multiple=True,
    type=click.Choice(["optimizer", "rng"]),
    help="Convert without this state when it cannot be carried (repeatable).",
)
@click.option("--force", is_flag=True, help="Replace a non-empty OUT.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars.")
def convert(
    directory: Path,
    target: str,
    out: Path,
    tag: str | None,
    zero_stage: int | None,
    world_size: int | None,
    precision: str | None,
    drop: tuple[str, ...],
    force: bool,
    progress: bool,
) -> None:
    """Convert DIRECTORY's checkpoint into a TARGET-backend save_dir OUT: weights,
    optimizer state, scheduler, RNG and loader state, so the run resumes there."""
    from lightrft.strategy.checkpoint.tools.convert import convert as run_convert
    from lightrft.strategy.checkpoint.tools.offline import open_checkpoint

    with _errors(), _progress("convert", progress) as update:
        source = open_checkpoint(directory, tag)
        report = run_convert(
            source,
            out,
            target,
            zero_stage=zero_stage,
            world_size=world_size,
            precision=precision,
            drop=drop,
            force=force,
            progress=update,
        )
    stage = f" ZeRO stage {zero_stage}" if target == "deepspeed" else ""
    dropped = f"; dropped: {', '.join(report.dropped)}" if report.dropped else ""
    click.echo(
        f"converted {source.path} ({source.metadata.get('backend')}) to {target}{stage} "
        f"at world size {report.world_size}: {report.output / report.tag}; "
        f"{report.verification.summary()}{dropped}"
    )
