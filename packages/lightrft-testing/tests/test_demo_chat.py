"""The main job (examples/grpo.py) on a chat model, as a user with a pretrained instruct
model runs it: a tiny Qwen2 in Hugging Face format whose tokenizer has a chat template
(made here, no download) and a JSONL of word problems. The engine receives the prompt in
the template, a step without reward signal leaves every weight as it was, completions
are logged, and ``--help`` shows the defaults a run uses. The fake strategy and engine,
in one process."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"
#: A ChatML template, as SmolLM2's and Qwen2's instruct models use.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>", "<pad>"]


def _job() -> Any:
    sys.path.insert(0, str(GRPO.parent))
    import grpo

    return grpo


def build_chat_model(path: Path) -> Path:
    """A character-level tokenizer with ChatML's special tokens and template (eos is
    ``<|im_end|>``, as in instruct models) and a random two-layer Qwen2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate([*characters, *SPECIAL])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<pad>"], bos_token_id=None,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def word_problems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Word problems with answers a random model never writes (a reward of 0 for every
    completion, so every RL step has no signal)."""
    rows = [
        {"prompt": f"Ana has {a} pears and buys {b} more. How many now?", "answer": 10**6 + a + b}
        for a in range(1, 9)
        for b in range(1, 6)
    ]
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_engine_receives_the_prompt_in_the_chat_template(
    chat_model: Path, word_problems: Path, tmp_path: Path
) -> None:
    grpo = _job()
    from transformers import AutoTokenizer

    config, opts = grpo.parse(
        ["--backend", "fake", "--engine_type", "fake", "--pretrain", str(chat_model),
         "--prompts", str(word_problems), "--held-out", "4", "--sft-steps", "0",
         "--steps", "1", "--system-prompt", "Answer with a number.", "--out", str(tmp_path)]
    )  # fmt: skip
    run = grpo.Run(config, opts)
    try:
        run.evaluate()
        received = run.strategy.inference_engine.last_prompts
    finally:
        run.strategy.close()
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    first = run.held_out[0]["prompt"]
    opening = tokenizer("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n",
                        add_special_tokens=False).input_ids  # fmt: skip
    closing = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    ids = list(received[0])
    assert ids[: len(opening)] == opening, tokenizer.decode(ids)
    assert ids[-len(closing) :] == closing
    plain = tokenizer(first, add_special_tokens=False).input_ids
    assert ids[len(opening) : -len(closing)] == plain
    # --chat-template none: the prompt as written
    config, opts = grpo.parse(
        ["--backend", "fake", "--engine_type", "fake", "--pretrain", str(chat_model),
         "--prompts", str(word_problems), "--held-out", "4", "--chat-template", "none",
         "--out", str(tmp_path / "plain")]
    )  # fmt: skip
    run = grpo.Run(config, opts)
    try:
        run.evaluate()
        assert list(run.strategy.inference_engine.last_prompts[0]) == plain
    finally:
        run.strategy.close()


def test_a_step_without_reward_signal_leaves_every_weight_and_logs_completions(
    chat_model: Path, word_problems: Path, tmp_path: Path
) -> None:
    """Every completion is wrong, so every advantage is 0: the steps are skipped (logged),
    and the finished run's model is the pretrained one bit for bit, though Adam's
    momentum and the KL term would otherwise have moved it."""
    done = subprocess.run(
        [sys.executable, str(GRPO), "--backend", "fake", "--engine_type", "fake",
         "--pretrain", str(chat_model), "--prompts", str(word_problems), "--held-out", "4",
         "--sft-steps", "0", "--steps", "2", "--new-tokens", "8", "--train_batch_size", "16",
         "--micro_train_batch_size", "8", "--n_samples_per_prompt", "4", "--eval-every", "2",
         "--samples-every", "1", "--kl-coef", "0.1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
             **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in rows[1:]] == [1, 1], rows
    assert "step 1: every advantage was 0" in done.stderr + done.stdout
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT: ")]
    assert result == [
        "RESULT: held-out accuracy 0.000 at the start -> 0.000 after 2 RL steps (+0.0 points), "
        "2 step(s) skipped (no reward signal)"
    ], done.stdout
    from safetensors.torch import load_file

    before = load_file(str(chat_model / "model.safetensors"))
    after = load_file(str(tmp_path / "final_model" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    kinds = {(s["step"], s["kind"]) for s in samples}
    assert kinds == {(0, "held_out"), (1, "rollout"), (2, "rollout"), (2, "held_out")}, kinds
    for sample in samples:
        assert set(sample) == {"step", "kind", "prompt", "completion", "answer", "reward"}
        assert sample["reward"] == 0.0 and sample["answer"] > 10**6
    # the run's settings as used, and the pretrained recipe's rates
    used = json.loads((tmp_path / "run_config.json").read_text())
    assert used["job"]["recipe"] == "pretrained" and used["job"]["rl_learning_rate"] == 1e-6
    assert used["strategy"]["actor_learning_rate"] == 1e-6


def _help_default(text: str, flag: str) -> str:
    """The ``(default: X)`` of ``flag`` in argparse's help text."""
    flat = " ".join(text.split())
    # the last mention: the options list, after the usage line
    start = [m.start() for m in re.finditer(rf"{flag}[ ,]", flat)][-1]
    return flat[flat.index("(default: ", start) + len("(default: ") :].split(")")[0]


def test_help_shows_the_defaults_a_run_uses(
    chat_model: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    grpo = _job()
    with pytest.raises(SystemExit):
        grpo.parse(["--help"])
    text = capsys.readouterr().out
    config, opts = grpo.parse([])
    for field in ("train_batch_size", "micro_train_batch_size", "n_samples_per_prompt",
                  "engine_type", "precision", "bf16", "backend", "seed"):  # fmt: skip
        assert _help_default(text, f"--{field.replace('_', '-')}") == repr(getattr(config, field))
    assert (config.train_batch_size, config.engine_type, config.bf16) == (256, "hf", False)
    rates = _help_default(text, "--rl-learning-rate")
    demo, pretrained = grpo.RECIPES["demo"], grpo.RECIPES["pretrained"]
    assert rates.startswith(f"{demo['rl_learning_rate']} for the built-in model")
    assert opts.rl_learning_rate == demo["rl_learning_rate"]
    assert config.actor_learning_rate == opts.sft_learning_rate == demo["sft_learning_rate"]
    config, opts = grpo.parse(["--pretrain", str(chat_model)])
    assert f"{pretrained['rl_learning_rate']} with --pretrain" in rates
    assert opts.rl_learning_rate == pretrained["rl_learning_rate"]
    assert opts.kl_coef == pretrained["kl_coef"] and opts.min_gain is None
    assert opts.new_tokens == pretrained["new_tokens"] == 512
    # --actor_learning_rate is the RL phase's rate; two different RL rates are an error
    config, opts = grpo.parse(["--sft-steps", "0", "--actor_learning_rate", "3e-6"])
    assert opts.rl_learning_rate == config.actor_learning_rate == 3e-6
    with pytest.raises(SystemExit):
        grpo.parse(["--actor_learning_rate", "3e-6", "--rl-learning-rate", "1e-6"])
    assert "disagree: they name the same rate" in capsys.readouterr().err
    # set in a config file, it means the same
    file = tmp_path / "job.yaml"
    file.write_text((GRPO.parent / "grpo.yaml").read_text() + "actor_learning_rate: 4.0e-6\n")
    config, opts = grpo.parse(["--config", str(file), "--sft-steps", "0"])
    assert opts.rl_learning_rate == config.actor_learning_rate == 4e-6
    assert isinstance(opts, argparse.Namespace)
