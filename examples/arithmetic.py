"""The main job's task: problems with one integer answer, a rule-based checker, and the
tiny character-level model that learns them here.

A problem is one JSON line, ``{"prompt": "12+7=", "answer": 19}``: the format a real
data set takes too (GSM8K-style questions with integer answers, ``--prompts``). The
checker reads the last integer in a completion (commas and a leading ``$`` allowed, as
GSM8K answers write them), so it grades ``"19"`` and ``"... so the answer is 19."``
alike.

The built-in task is addition of two numbers below ``--operand-limit``, learnt by a
two-layer Qwen2 over a 15-token character vocabulary. Its warm-up demonstrations are
imperfect, as human ones are: where a sum carries, a share of them
(``--careless-demos``, 0.8 by default) drops the carry (``17+25=32``). The warm-up
model learns that habit, so its greedy answers to carrying sums are mostly wrong; RL,
rewarded by the checker alone, has to find the right ones by sampling. A problem row
may carry such a ``careless`` answer; real data sets have none and are demonstrated
with their answers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The character vocabulary of the built-in model (one token per character).
CHARACTERS = "0123456789+= "
EOS, PAD = "<eos>", "<pad>"

#: The tiny model's config (head_dim 64: vLLM's CPU kernels need at least that).
MODEL: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "tie_word_embeddings": False, "bos_token_id": None,
}  # fmt: skip

_INTEGER = re.compile(r"-?\$?\d[\d,]*")


def integer_answer(text: str) -> int | None:
    """The last integer written in ``text`` (``1,234`` and ``$12`` included), or None."""
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "").replace("$", "")
    try:
        return int(digits)
    except ValueError:
        return None


def is_correct(completion: str, answer: int) -> bool:
    """The exact-match reward's rule: the completion's last integer is the answer."""
    return integer_answer(completion) == answer


def addition_problems(
    limit: int, held_out: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every ``a+b=`` with ``a, b < limit`` (zero-padded: ``07+25=``), shuffled by
    ``seed``: ``held_out`` of them for evaluation only, the rest for training."""
    pairs = [(a, b) for a in range(limit) for b in range(limit)]
    random.Random(seed).shuffle(pairs)
    if not 0 < held_out < len(pairs):
        raise ValueError(f"held_out={held_out} must be within 1..{len(pairs) - 1}")
    width = len(str(limit - 1))  # operands written at one width: digits line up
    rows: list[dict[str, Any]] = []
    for a, b in pairs:
        row: dict[str, Any] = {"prompt": f"{a:0{width}d}+{b:0{width}d}=", "answer": a + b}
        if a % 10 + b % 10 >= 10:
            row["careless"] = a + b - 10  # the units digit, without carrying the ten
        rows.append(row)
    return rows[held_out:], rows[:held_out]


def demonstration(problem: dict[str, Any], careless: float, draw: float) -> str:
    """The warm-up's target for ``problem``: its answer, or (where it has a careless
    one and ``draw < careless``) the careless answer."""
    if "careless" in problem and draw < careless:
        return str(problem["careless"])
    return str(problem["answer"])


def write_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_problems(path: Path) -> list[dict[str, Any]]:
    """Problems from a JSONL file: each line needs ``prompt`` (text) and ``answer`` (an
    integer, or text holding one, as GSM8K's ``#### 42``)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}:{number}: not a JSON object ({exc.msg} at column {exc.colno}); "
                'write one problem a line: {"prompt": "...", "answer": 42}'
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}:{number}: a problem is a JSON object, got {type(row).__name__}; "
                'write one problem a line: {"prompt": "...", "answer": 42}'
            )
        answer = row.get("answer")
        value = answer if isinstance(answer, int) else integer_answer(str(answer))
        if "prompt" not in row or value is None:
            raise ValueError(
                f"{path}:{number}: a problem needs 'prompt' and an integer 'answer', got "
                f"{sorted(row)} (answer={answer!r})"
            )
        rows.append({**row, "prompt": str(row["prompt"]), "answer": value})
    if not rows:
        raise ValueError(f"{path} holds no problems")
    return rows


def build_tiny_model(path: Path, seed: int) -> None:
    """Save a random tiny Qwen2 and its character tokenizer with ``save_pretrained``, as
    any Hugging Face model directory (the engines load it from disk)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {c: i for i, c in enumerate(CHARACTERS)}
    vocab.update({EOS: len(vocab), PAD: len(vocab) + 1})
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD)
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(vocab), eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], **MODEL
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
