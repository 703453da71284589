"""A checkpoint's model as a Hugging Face model directory, in one process on CPU.

    report = export_hf(open_checkpoint("ckpts"), Path("hf_out"))

Reads the checkpoint's full weights (:mod:`.offline`): what ``save_model`` writes (a
tied parameter under its first name only; Hugging Face re-ties it on load; DeepSpeed's
fp32 master weights), or cast to ``dtype``, then
writes safetensors and ``config.json`` into a staging directory, reads every tensor back
and compares it with its source, and only then renames the staging directory to the
output. A LoRA checkpoint (its metadata records the adapter's peft config) exports the
adapter in peft's format, or with ``merge_lora`` the merged model. The tokenizer's files
(:mod:`lightrft.strategy.checkpoint.tokenizer`: the checkpoint's own, or
``tokenizer``'s) go into the same staging
directory, so a failed export leaves no output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lightrft.strategy.checkpoint.layout import HF_CONFIG_FILE, CheckpointError, CheckpointInfo
from lightrft.strategy.checkpoint.tokenizer import export_tokenizer
from lightrft.strategy.checkpoint.tools.offline import read_contents
from lightrft.strategy.checkpoint.tools.staging import check_output, staged_output
from lightrft.strategy.checkpoint.tools.verify import Verification
from lightrft.strategy.lora import base_name, merge_state_dict, peft_adapter_state

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: called as tensors are written and verified."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: peft's adapter weights file.
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class ExportReport:
    output: Path
    files: list[Path]
    tensors: int
    bytes: int
    verification: Verification
    #: where the written tokenizer came from (the checkpoint's ``tokenizer/`` or the
    #: ``tokenizer`` directory given); None: no tokenizer was written
    tokenizer: Path | None = None


def read_hf_config(info: CheckpointInfo, hf_config: str | Path | None) -> str:
    """The config.json text: from ``hf_config`` (a model directory or a config file)
    when given, else the one ``save_ckpt`` recorded."""
    if hf_config is not None:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            text = path.read_text(encoding="utf-8")
            json.loads(text)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"--hf-config {hf_config}: cannot read a JSON config from {path} ({exc}); give "
                "a Hugging Face model directory or its config.json"
            ) from exc
        return text
    recorded = info.path / HF_CONFIG_FILE
    if not recorded.is_file():
        raise CheckpointError(
            f"{info.path} records no Hugging Face config ({HF_CONFIG_FILE}): the model had no "
            "`config`, or the checkpoint predates lightrft-strategy 0.3. Pass --hf-config "
            "with the model directory (or config.json) the run started from"
        )
    return recorded.read_text(encoding="utf-8")


def base_tied(info: CheckpointInfo) -> dict[str, str]:
    """The tied names of a LoRA checkpoint's model, by the base model's names."""
    tied = (info.metadata.get("model") or {}).get("tied") or {}
    return {
        alias: first
        for name, target in tied.items()
        if (alias := base_name(name)) is not None and (first := base_name(target)) is not None
    }


def hf_state(
    info: CheckpointInfo,
    weights: dict[str, torch.Tensor],
    dtype: str | None,
    tied: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors a Hugging Face directory holds, as ``save_model`` writes them: the
    tied parameters' second names left out, each tensor as the checkpoint holds it
    (DeepSpeed's fp32 master weights; FSDP2's parameters) or cast to ``dtype``;
    contiguous and not sharing memory."""
    if tied is None:
        tied = (info.metadata.get("model") or {}).get("tied") or {}
    target = DTYPES[dtype] if dtype is not None else None
    return {
        name: tensor.detach().to("cpu", target or tensor.dtype).contiguous().clone()
        for name, tensor in weights.items()
        if name not in tied
    }


def export_hf(
    info: CheckpointInfo,
    out: Path,
    *,
    hf_config: str | Path | None = None,
    dtype: str | None = None,
    force: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    progress: Progress | None = None,
    merge_lora: bool = False,
    tokenizer: str | Path | None = None,
) -> ExportReport:
    """Export ``info``'s model to ``out`` (see the module's docstring). A LoRA
    checkpoint exports its adapter in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``), or with ``merge_lora`` the merged model as a Hugging
    Face directory. The tokenizer written beside it is ``tokenizer``'s (a directory
    ``AutoTokenizer.from_pretrained`` loads) when given, else the checkpoint's own when
    ``save_ckpt`` recorded one, else none."""
    from safetensors import safe_open

    from lightrft.strategy.hf_export import write_weight_files

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    check_output(out, force=force, source=info.path)  # before reading anything
    settings = info.metadata.get("lora")
    if merge_lora and not settings:
        raise CheckpointError(
            f"--merge-lora: {info.path} holds no LoRA adapter (its model was trained in "
            "full); export it without --merge-lora"
        )
    config_text = read_hf_config(info, hf_config) if not settings or merge_lora else None
    tokenizer_source = export_tokenizer(info, Path(tokenizer) if tokenizer is not None else None)
    weights = read_contents(info, optimizer=False, progress=progress).weights
    if settings and merge_lora:  # the merged model, under the base model's names
        weights = merge_state_dict(weights, settings)
        state = hf_state(info, weights, dtype, tied=base_tied(info))
    elif settings:  # the adapter alone, in peft's format
        state = hf_state(info, peft_adapter_state(weights, settings), dtype)
    else:
        state = hf_state(info, weights, dtype)
    with staged_output(out, force=force, source=info.path) as staging:
        if tokenizer_source is not None:  # first: the model's own files win a name clash
            tokenizer_source.write(staging)
        if settings and not merge_lora:
            from safetensors.torch import save_file

            save_file(state, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
            files = [staging / ADAPTER_FILE]
            adapter_config = {k: v for k, v in settings.items() if k != "adapter_name"}
            (staging / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        else:
            files = write_weight_files(state, staging, max_shard_bytes)
            (staging / "config.json").write_text(str(config_text), encoding="utf-8")
        verification = Verification()
        seen: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    seen.add(name)
                    if name in state:
                        verification.check(name, state[name], handle.get_tensor(name))
                        if progress is not None:
                            progress("verify", len(seen), len(state))
        verification.extra(sorted(seen - set(state)))
        for name in sorted(set(state) - seen):
            verification.check(name, state[name], None)
        verification.raise_if_failed(f"the export of {info.path}")
    total = sum(t.numel() * t.element_size() for t in state.values())
    return ExportReport(
        out.absolute(), [out.absolute() / f.name for f in files], len(state), total,
        verification, tokenizer_source.path if tokenizer_source is not None else None,
    )  # fmt: skip
