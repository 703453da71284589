"""The TRL side of ``vs_trl.py``: TRL's ``GRPOTrainer`` on the demo's GRPO job, one process
per rank under torchrun (CPU, DDP on gloo, generating with the training model).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/_trl_side.py \\
        --result FILE -- <examples/grpo.py flags>

The job is read from ``examples/grpo.py``'s own parser given the same flags as our side
(``--pretrain``, ``--recipe``, ``--steps``, ``--prompts``...): its configuration
(grpo.yaml and the flags) gives the group size, the batch, the seed, Adam's betas, the
weight decay, the gradient clipping, and its options the learning rate, KL coefficient,
completion length, temperature, chat template, system prompt and the problems (the
demo's ``load_problems``: ``--prompts``/``--eval-prompts`` or the built-in task); the
prompts are encoded by the demo's ``PromptEncoder`` and graded by the demo's checker
(``arithmetic.is_correct``), and ``prompting.stop_ids`` ends completions.

Rank 0 writes ``--result`` (JSON): each step's wall clock (``on_step_begin`` to
``on_step_end`` of a ``TrainerCallback``), where its seconds went (``generate_s``: the
model's ``generate``; ``rollout_s``: the whole of ``_generate_and_score_completions``,
generation, rewards and advantages; the rest is the forward, backward, clipping and
optimizer step), each step's mean reward over all ranks, and the greedy held-out
accuracy of the demo's held-out problems before and after training.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import arithmetic  # noqa: E402  (the demo's task)
import grpo  # noqa: E402  (the demo's job: its parser and defaults)
from prompting import PromptEncoder, stop_ids  # noqa: E402


def greedy_accuracy(
    model: Any, tokenizer: Any, prompting: PromptEncoder, problems: list[dict[str, Any]],
    new_tokens: int, stops: tuple[int, ...], pad: int,
) -> float:  # fmt: skip
    """The demo's evaluation: greedy, at most ``new_tokens`` tokens, ending at ``stops``,
    graded by the demo's checker; one left-padded batch through ``model.generate``."""
    from transformers import GenerationConfig

    ids = [prompting.encode(p["prompt"]) for p in problems]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=list(stops), pad_token_id=pad
    )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    model.train(was_training)
    right = 0
    for row, problem in zip(out[:, width:].tolist(), problems, strict=True):
        ends = [k for k, token in enumerate(row) if token in stops]
        tokens = row[: ends[0]] if ends else row
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        right += arithmetic.is_correct(text, problem["answer"])
    return right / len(problems)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result", type=Path, required=True, help="JSON written by rank 0")
    parser.add_argument("job", nargs=argparse.REMAINDER, help="-- then examples/grpo.py's flags")
    args = parser.parse_args(argv)
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    config, opts = grpo.parse(job)
    if not opts.pretrain:
        raise SystemExit("the TRL side needs --pretrain (the model both sides start from)")
    if config.resolved_precision == "fp16":
        raise SystemExit("the TRL side runs fp32 or bf16 on CPU, not fp16")

    trl = importlib.import_module("trl")
    datasets = importlib.import_module("datasets")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    group = config.n_samples_per_prompt
    per_rank = config.train_batch_size // world  # completions per rank and step (16 x 8)
    model_dir = Path(opts.pretrain)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompting = PromptEncoder(tokenizer, opts.chat_template, opts.system_prompt)
    stops = stop_ids(tokenizer, model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_set, held_out = grpo.load_problems(opts, config.seed)  # --prompts, as ours
    rows = [{"prompt": prompting.text(p["prompt"]), "answer": p["answer"]} for p in train_set]
    # TRL tokenizes the prompt text itself: it must see the ids our side's engine sees
    for row, problem in zip(rows[:50], train_set, strict=False):
        theirs = tokenizer(text=[row["prompt"]])["input_ids"][0]
        if list(theirs) != prompting.encode(problem["prompt"]):
            raise SystemExit(f"prompt {problem['prompt']!r}: TRL's ids {theirs} differ from ours")

    def exact_match(completions: list[str], answer: list[int], **_: Any) -> list[float]:
        pairs = zip(completions, answer, strict=True)
        return [float(arithmetic.is_correct(c, a)) for c, a in pairs]

    betas = config.adam_betas
    args_trl = trl.GRPOConfig(
        output_dir=str(Path(opts.out) / "trl"),
        seed=config.seed,
        max_steps=opts.steps,
        per_device_train_batch_size=per_rank,  # one generation batch per optimizer step
        gradient_accumulation_steps=1,
        num_generations=group,
        num_iterations=1,
        max_completion_length=opts.new_tokens,
        temperature=opts.temperature,
        learning_rate=opts.rl_learning_rate,
        lr_scheduler_type="constant",  # the demo's constant_with_warmup at warm-up ratio 0
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=config.l2,
        max_grad_norm=config.max_norm,
        beta=opts.kl_coef,  # 0: no KL term, no reference model
        loss_type="grpo",  # each completion's token mean, then their mean (seq-mean-token-mean)
        scale_rewards="group",  # (r - group mean) / (group std + 1e-4), as the demo
        # the demo's precision (grpo.yaml: fp32; GRPOConfig's default is bf16): with bf16
        # both sides keep fp32 weights and compute under bf16 autocast
        bf16=config.resolved_precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,  # GRPOConfig's default is True; the demo has none
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,  # every parameter is used (True costs a graph walk)
        use_vllm=False,  # generate with the training model
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,  # the reward reads the "answer" column
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    steps: list[dict[str, float]] = []
    current: dict[str, float] = {}

    def timed(name: str, method: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = method(*a, **k)
            current[name] = current.get(name, 0.0) + time.perf_counter() - t0
            return out

        return wrapper

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            current.clear()
            current["begin"] = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            current["end"] = time.perf_counter()
            steps.append(dict(current))

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args_trl,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    calculate_rewards = trainer._calculate_rewards

    def rewards(*a: Any, **k: Any) -> torch.Tensor:
        out: torch.Tensor = calculate_rewards(*a, **k)  # gathered from every rank
        current["reward"] = float(out.nanmean())
        return out

    trainer._calculate_rewards = rewards
    trainer._generate_single_turn = timed("generate_s", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed(
        "rollout_s", trainer._generate_and_score_completions
    )
    evaluate = (tokenizer, prompting, held_out, opts.new_tokens, stops, pad)
    start = greedy_accuracy(model, *evaluate) if rank == 0 else None
    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    if rank == 0:
        end = greedy_accuracy(trainer.model, *evaluate)
        result = {
            "steps": steps,
            "train_wall_s": train_wall,
            "held_out_start": start,
            "held_out_end": end,
            "world": world,
            "problems_per_rank": per_rank // group,
            "group": group,
            "ddp": type(trainer.model_wrapped).__name__,
            "backend": dist.get_backend() if dist.is_initialized() else None,
        }
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
