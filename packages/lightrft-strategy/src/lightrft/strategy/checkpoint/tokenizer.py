"""The model's tokenizer in a checkpoint and in its Hugging Face export.

``save_ckpt(..., tokenizer=tok)`` has rank 0 write ``tok.save_pretrained`` into the tag's
``tokenizer/`` directory while the save is staged, so the metadata (written last) lists
its files with their sizes like every other file. ``lightrft ckpt export`` copies the
files the metadata lists beside the weights, or, with ``--tokenizer DIR``, DIR's
tokenizer files, once transformers' ``AutoTokenizer`` has loaded DIR (so a DIR that does
not load is refused). Copied, not loaded and saved again: the export's files are DIR's
byte for byte, and load as DIR does (a reload and save adds loading arguments to
``tokenizer_config.json``, and transformers 5 may rebuild a tokenizer as the class its
``config.json`` names).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from lightrft.strategy.checkpoint.layout import TOKENIZER_DIR, CheckpointError, CheckpointInfo

#: the files by which a directory is recognised as holding a tokenizer (any one will do)
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
#: the files ``--tokenizer DIR`` copies when DIR has them: those above, the rest that a
#: tokenizer's or processor's ``save_pretrained`` writes, and the vocabulary files the
#: loaded tokenizer's class names (``vocab_files_names``)
COPIED_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
_FIX = (
    "give the directory the run's tokenizer was saved to with save_pretrained (the model "
    "directory the run started from usually holds it)"
)


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a ``save_ckpt`` tokenizer that cannot be saved (before anything is written)."""
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"save_ckpt tokenizer={tokenizer!r:.80} ({type(tokenizer).__name__}) has no "
            "save_pretrained method; pass a transformers tokenizer or processor (e.g. "
            "AutoTokenizer.from_pretrained(path)), or leave tokenizer=None"
        )


def write_tokenizer(tokenizer: Any, tag_dir: Path) -> None:
    """``tokenizer.save_pretrained`` into ``tag_dir/tokenizer`` (nothing when None)."""
    if tokenizer is not None:
        (tag_dir / TOKENIZER_DIR).mkdir(exist_ok=True)
        tokenizer.save_pretrained(str(tag_dir / TOKENIZER_DIR))


def recorded_tokenizer_files(info: CheckpointInfo) -> list[str]:
    """The tokenizer files the checkpoint's metadata lists (paths inside ``tokenizer/``,
    size-checked when the checkpoint was opened); empty when it records no tokenizer."""
    files = info.metadata.get("files") or {}
    return sorted(
        PurePath(*parts[1:]).as_posix()
        for name in files
        if len(parts := PurePath(name).parts) > 1 and parts[0] == TOKENIZER_DIR
    )


@dataclass(frozen=True)
class TokenizerSource:
    """An export's tokenizer: ``files`` (paths relative to ``path``) to copy."""

    path: Path
    files: tuple[str, ...]

    def write(self, directory: Path) -> None:
        """Copy the tokenizer's files into ``directory`` (an export's staging directory)."""
        for name in self.files:
            source, target = self.path / name, directory / name
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)


def tokenizer_dir_files(path: Path) -> tuple[str, ...]:
    """The tokenizer files of the directory ``path`` (see :data:`COPIED_FILES`), once
    ``AutoTokenizer.from_pretrained`` has loaded it; else a :class:`CheckpointError`
    naming the path and the fix."""
    if not path.is_dir():
        raise CheckpointError(f"--tokenizer {path}: no such directory; {_FIX}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        known = ", ".join(TOKENIZER_FILES)
        raise CheckpointError(f"--tokenizer {path} holds no tokenizer (none of {known}); {_FIX}")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise CheckpointError(
            f"--tokenizer {path}: loading a tokenizer needs transformers; install it "
            "(pip install transformers)"
        ) from exc
    try:
        loaded = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"--tokenizer {path}: transformers' AutoTokenizer cannot load it "
            f"({type(exc).__name__}: {first}); {_FIX}"
        ) from exc
    vocab_files = getattr(loaded, "vocab_files_names", None) or {}
    names = dict.fromkeys([*COPIED_FILES, *map(str, vocab_files.values())])
    return tuple(name for name in names if (path / name).exists())


def export_tokenizer(info: CheckpointInfo, tokenizer_dir: Path | None) -> TokenizerSource | None:
    """The tokenizer an export of ``info`` writes: ``tokenizer_dir``'s when given (loaded
    now, so a bad one fails before anything is read or written), else the checkpoint's
    own; None when there is neither."""
    if tokenizer_dir is not None:
        return TokenizerSource(Path(tokenizer_dir), tokenizer_dir_files(Path(tokenizer_dir)))
    files = recorded_tokenizer_files(info)
    return TokenizerSource(info.path / TOKENIZER_DIR, tuple(files)) if files else None
