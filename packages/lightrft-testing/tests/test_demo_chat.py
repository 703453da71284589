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

from lightrft.testing.models import save_tiny_chat_model

GRPO = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


def _job() -> Any:
    sys.path.insert(0, str(GRPO.parent))
    import grpo

    return grpo


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("chat") / "model")


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
        "KL to the reference 0 on held-out prompts, 2 step(s) skipped (no reward signal)"
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
    assert used["job"]["recipe"] == "pretrained" and used["job"]["rl_learning_rate"] == 1e-5
    assert used["strategy"]["actor_learning_rate"] == 1e-5


def _help_default(text: str, flag: str) -> str:
    """The ``(default: X)`` of ``flag`` in argparse's help text."""
    flat = " ".join(text.split())
    # the last mention: the options list, after the usage line
    start = [m.start() for m in re.finditer(rf"{flag}[ ,]", flat)][-1]
    return flat[flat.index("(default: ", start) + len("(default: ") :].split(")")[0]


def test_help_shows_the_defaults_a_run_uses(
    chat_model: Path,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
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
    # --actor_learning_rate is --rl-learning-rate's other name: the config field's 1e-5
    # is no rate a run uses, so its help does not show it
    assert _help_default(text, "--actor-learning-rate") == rates
    assert opts.rl_learning_rate == demo["rl_learning_rate"]
    # the config's actor_learning_rate is the RL rate, warm-up or not (run_config.json)
    assert config.actor_learning_rate == opts.rl_learning_rate
    assert opts.sft_learning_rate == demo["sft_learning_rate"] and opts.sft_steps == 150
    config, opts = grpo.parse(["--pretrain", str(chat_model)])
    assert f"{pretrained['rl_learning_rate']} for a pretrained one" in rates
    assert opts.rl_learning_rate == pretrained["rl_learning_rate"]
    assert opts.kl_coef == pretrained["kl_coef"] and opts.min_gain is None
    assert opts.new_tokens == pretrained["new_tokens"] == 96
    assert opts.sft_steps == pretrained["sft_steps"] == 0  # no warm-up on bare answers
    # the recipe's batch (RECIPE_CONFIG), under the file, the environment and the flags
    assert (config.n_samples_per_prompt, config.train_batch_size) == (8, 32)
    config, _ = grpo.parse(["--pretrain", str(chat_model), "--train_batch_size", "64"])
    assert config.train_batch_size == 64
    monkeypatch.setenv("LIGHTRFT_TRAIN_BATCH_SIZE", "48")
    assert grpo.parse(["--pretrain", str(chat_model)])[0].train_batch_size == 48
    monkeypatch.delenv("LIGHTRFT_TRAIN_BATCH_SIZE")
    mine = tmp_path / "mine.yaml"
    mine.write_text("train_batch_size: 16\n")
    assert (
        grpo.parse(["--pretrain", str(chat_model), "--config", str(mine)])[0].train_batch_size == 16
    )
    with pytest.raises(SystemExit):
        grpo.parse(["--pretrain", str(chat_model), "--help"])
    shown = capsys.readouterr().out  # --help with a model: the pretrained recipe's batch
    assert _help_default(shown, "--train-batch-size") == "32"
    # --actor_learning_rate is the RL phase's rate (one flag, three names)
    config, opts = grpo.parse(["--sft-steps", "0", "--actor_learning_rate", "3e-6"])
    assert opts.rl_learning_rate == config.actor_learning_rate == 3e-6
    config, opts = grpo.parse(["--actor_learning_rate", "3e-6"])  # with the warm-up too
    assert config.actor_learning_rate == 3e-6 and opts.sft_learning_rate == 1e-3
    # set in a config file, it means the same
    file = tmp_path / "job.yaml"
    file.write_text((GRPO.parent / "grpo.yaml").read_text() + "actor_learning_rate: 4.0e-6\n")
    config, opts = grpo.parse(["--config", str(file), "--sft-steps", "0"])
    assert opts.rl_learning_rate == config.actor_learning_rate == 4e-6
    assert isinstance(opts, argparse.Namespace)


def test_every_job_flag_shows_the_default_a_run_uses(
    capsys: pytest.CaptureFixture[str], chat_model: Path
) -> None:
    """Each of the job's own flags: the help's default is the value parse() gives, for
    the built-in model and (the recipe's flags) for a pretrained one."""
    grpo = _job()
    effective, _ = grpo._effective_config([])
    parser = grpo.build_parser(effective)
    _, demo = grpo.parse([])
    _, pretrained = grpo.parse(["--pretrain", str(chat_model)])
    helps = {a.dest: a.help for a in parser._actions if a.dest in grpo.JOB_OPTIONS}
    assert set(helps) == set(grpo.JOB_OPTIONS)
    for name, help_text in helps.items():
        flag = name
        shown = str(help_text).rsplit("(default: ", 1)[1].removesuffix(")")
        if name in grpo.RECIPES["demo"]:
            want = f"{getattr(demo, name)} for the built-in model, "
            want += f"{getattr(pretrained, name)} for a pretrained one"
        elif name == "resume":
            want = "off" if not demo.resume else "on"
        elif name == "recipe":
            want = "auto"  # resolved by the model's source: demo, pretrained
            assert (demo.recipe, pretrained.recipe) == ("demo", "pretrained")
        else:
            want = str(getattr(demo, name))
        assert shown == want, (flag, shown, want)


def test_the_recipe_follows_the_model_wherever_it_is_given(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pretrain:` in a config file or LIGHTRFT_PRETRAIN gets the pretrained recipe, as
    --pretrain does (issue 34's harmful demo rates otherwise), and the run says where
    its model came from."""
    grpo = _job()
    file = tmp_path / "job.yaml"
    file.write_text((GRPO.parent / "grpo.yaml").read_text() + f"pretrain: {chat_model}\n")
    _, opts = grpo.parse(["--config", str(file)])
    assert (opts.recipe, opts.pretrain, opts.model_source) == ("pretrained", chat_model, str(file))
    assert (opts.rl_learning_rate, opts.sft_steps, opts.kl_coef) == (1e-5, 0, 1e-3)
    monkeypatch.setenv("LIGHTRFT_PRETRAIN", str(chat_model))
    _, opts = grpo.parse([])
    assert (opts.recipe, opts.pretrain, opts.model_source) == (
        "pretrained", chat_model, "LIGHTRFT_PRETRAIN"
    )  # fmt: skip
    _, opts = grpo.parse(["--recipe", "demo"])  # asked for, it wins
    assert (opts.recipe, opts.rl_learning_rate) == ("demo", 2e-4)


def test_a_step_without_signal_after_a_trained_step_leaves_every_weight(
    chat_model: Path, word_problems: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 has a signal (every other completion right) and trains; step 2 has none and
    is skipped: its weights are step 1's bit for bit. The control shows what the skip
    prevents: Adam stepped on step 2's zero gradient moves every weight by its momentum."""
    import itertools

    grpo = _job()
    config, opts = grpo.parse(
        ["--backend", "fake", "--engine_type", "fake", "--pretrain", str(chat_model),
         "--prompts", str(word_problems), "--held-out", "4", "--steps", "2",
         "--new-tokens", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
         "--n_samples_per_prompt", "4", "--rl-learning-rate", "1e-3", "--kl-coef", "0",
         "--out", str(tmp_path)]
    )  # fmt: skip
    calls, signal = itertools.count(), {"on": True}
    monkeypatch.setattr(
        grpo.arithmetic, "is_correct", lambda c, a: signal["on"] and next(calls) % 2 == 0
    )
    run = grpo.Run(config, opts)
    try:
        first, _ = run.step(1)
        assert first["skipped"] == 0 and first["reward"] == 0.5
        trained = {k: v.detach().clone() for k, v in run.actor.state_dict().items()}
        signal["on"] = False
        second, _ = run.step(2)
        assert second["skipped"] == 1 and second["reward"] == 0.0
        after = run.actor.state_dict()
        assert all(torch.equal(trained[k], after[k]) for k in trained)
        # the control: a zero gradient stepped by this Adam moves the weights
        for parameter in run.actor.parameters():
            parameter.grad = torch.zeros_like(parameter)
        run.optim.step()
        moved = run.actor.state_dict()
        assert not any(torch.equal(trained[k], moved[k]) for k in trained if "weight" in k)
    finally:
        run.strategy.close()


LAUNCH = GRPO.with_name("launch.py")


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    """examples/launch.py (torchrun) running the job on one rank, as the nox sessions do."""
    return subprocess.run(
        [sys.executable, str(LAUNCH), "--nproc-per-node", "1", str(GRPO), *args],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
             **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}},
    )  # fmt: skip


@pytest.mark.parametrize("case", ["finished", "below the gain", "bad problem file"])
def test_exit_status_end_to_end_through_launch(
    case: str, chat_model: Path, word_problems: Path, tmp_path: Path
) -> None:
    """0 when the run finished, 1 below --min-gain, 2 for bad input (one line naming the
    file, the line and the fix), as README says; launch.py's last line names the rank."""
    problems = word_problems
    if case == "bad problem file":
        problems = tmp_path / "broken.jsonl"
        lines = word_problems.read_text().splitlines()
        problems.write_text("\n".join([lines[0], "{'prompt': 'single quotes'}", *lines[1:]]))
    gain = ["--min-gain", "2"] if case == "below the gain" else []
    done = _launch(
        "--backend", "fake", "--engine_type", "fake", "--pretrain", str(chat_model),
        "--prompts", str(problems), "--held-out", "4", "--steps", "1", "--new-tokens", "4",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--n_samples_per_prompt", "4",
        "--eval-every", "1",
        "--out", str(tmp_path / "run"), *gain,
    )  # fmt: skip
    code = {"finished": 0, "below the gain": 1, "bad problem file": 2}[case]
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-3000:]
    if code:
        assert done.stderr.strip().splitlines()[-1].startswith(f"launch: rank 0 exited {code}")
    if case == "bad problem file":
        named = [line for line in done.stderr.splitlines() if line.startswith("grpo: ")]
        assert named == [
            f"grpo: {problems}:2: not a JSON object (Expecting property name enclosed in "
            "double quotes at column 2); write one problem a line: "
            '{"prompt": "...", "answer": 42}'
        ], done.stderr
        assert "Traceback" not in done.stderr
    if case == "below the gain":
        assert "below --min-gain 2.0 (exit 1)" in done.stdout


def test_a_bad_config_value_exits_2_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    grpo = _job()
    assert grpo.main(["--backend", "fake", "--zero_stage", "7"]) == 2
    assert "zero_stage=7" in caplog.text
