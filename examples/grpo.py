"""RL with verifiable rewards on CPU: a supervised warm-up, then GRPO, with a trainer and
a rollout engine sharing the ranks, and held-out accuracy before and after RL.

The task (``arithmetic.py``): problems with one integer answer, checked by rule. By
default a tiny character-level Qwen2 (built here, no download) learns two-number
addition: ``--sft-steps`` supervised steps leave it partly right, then ``--steps`` GRPO
steps with an exact-match reward raise its greedy accuracy on problems it never trains
on. Each GRPO step:

1. the policy's weights go to the engine (``strategy.update_engine_weights``);
2. every rank draws its problems (seeded by step and rank) and the engine samples
   ``n_samples_per_prompt`` completions per problem with their log-probabilities
   (``strategy.gather_and_generate``);
3. the reward is 1 for a right answer, 0 otherwise; advantages are rewards normalised
   within each problem's group (GRPO);
4. the trainer recomputes the tokens' log-probabilities; their gap to the engine's is
   logged (``lightrft.strategy.rollout_correction``) and, with ``--tis-cap`` > 0, the
   policy loss is weighted by the truncated importance ratio trainer/engine; a KL term
   to the frozen reference model is added (``strategy.backward`` / ``optimizer_step``).

Only the public API is used, so the same file runs on every strategy and engine the
configuration selects (``--backend fsdp2|deepspeed|fake``, ``--zero_stage``,
``--engine_type hf|vllm|sglang|fake``, ``--device``), and on a real model and data set:
``--pretrain`` a Hugging Face model directory (with its tokenizer) and ``--prompts`` a
JSONL of ``{"prompt": ..., "answer": <integer>}`` (``--eval-prompts`` for the held-out
set, else ``--held-out`` problems of ``--prompts`` are kept aside). The run directory
(``--out``) gets ``metrics.jsonl``, TensorBoard logs (``use_tensorboard``), ``plot.png``
and rotated checkpoints; ``--resume`` continues from the latest checkpoint with the
same per-step metrics as an uninterrupted run (``--stop-after N`` stops after step N as
an interruption would). It exits 1 unless RL raised held-out accuracy by ``--min-gain``.

    torchrun --nproc-per-node 2 examples/grpo.py            # the default: 2 ranks, FSDP2, HF
    python examples/grpo.py --backend fake --engine_type fake --steps 5
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightrft.config import ConfigError, StrategyConfig
from lightrft.engines import SamplingParams
from lightrft.strategy import get_strategy, ulysses
from lightrft.strategy.rollout_correction import logprob_mismatch, truncated_importance_weights
from lightrft.strategy.run_log import RunLog, plot_metrics, read_metrics

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import arithmetic  # noqa: E402  (the task, beside this file)

log = logging.getLogger("grpo")

#: The plot's panels: y-axis label (unit) -> metrics drawn in it.
PANELS = {
    "fraction right": ["reward", "held_out_accuracy"],
    "loss": ["sft_loss", "loss"],
    "KL (nats/token)": ["kl", "rollout_kl"],
    "rollout log-prob gap (nats)": ["logprob_abs_diff", "logprob_max_abs_diff"],
    "entropy (nats/token)": ["entropy"],
    "response length (tokens)": ["response_length"],
    "seconds per step": ["generate_s", "train_s", "sync_s"],
    "tokens per second": ["tokens_per_s"],
}


class Batch:
    """Right-padded sequences (prompt then completion), with the mask of each row's
    completion tokens as predicted from the position before them."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], pad: int) -> None:
        width = max(len(p) + len(c) for p, c in rows)
        self.ids = torch.full((len(rows), width), pad, dtype=torch.long)
        self.attention = torch.zeros((len(rows), width), dtype=torch.long)
        self.mask = torch.zeros((len(rows), width - 1))  # over targets ids[:, 1:]
        for i, (prompt, completion) in enumerate(rows):
            n = len(prompt) + len(completion)
            self.ids[i, :n] = torch.tensor(prompt + completion)
            self.attention[i, :n] = 1
            self.mask[i, len(prompt) - 1 : n - 1] = 1

    def rows(self, start: int, stop: int, device: torch.device) -> Batch:
        part = Batch.__new__(Batch)
        part.ids, part.attention, part.mask = (
            t[start:stop].to(device) for t in (self.ids, self.attention, self.mask)
        )
        return part

    def spread(self, per_row: list[list[float]]) -> torch.Tensor:
        """Per-completion-token values (one list per row) laid out like ``mask``."""
        out = torch.zeros_like(self.mask)
        for i, values in enumerate(per_row):
            columns = self.mask[i].nonzero().flatten()[: len(values)]
            out[i, columns] = torch.tensor(values[: len(columns)], dtype=out.dtype)
        return out


def token_logprobs(
    model: Any, batch: Batch, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's log-probabilities of every next token at ``temperature`` (batch,
    width - 1), and with ``entropy`` the entropy of each predicted distribution."""
    logits = model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1].float()
    logp = (logits / temperature).log_softmax(-1)
    picked = logp.gather(-1, batch.ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1).detach() if entropy else None
    return picked, ent


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward minus its problem group's mean, over the group's std."""
    grouped = rewards.view(-1, group)
    normalised = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)
    return normalised.view(-1)


def set_learning_rate(optim: Any, sched: Any, lr: float) -> None:
    """Switch to the RL phase's learning rate: the schedule keeps its shape (its factor
    at this step applies to the new rate)."""
    bases = getattr(sched, "base_lrs", None) or [group["lr"] for group in optim.param_groups]
    for group, base in zip(optim.param_groups, bases, strict=True):
        group["lr"] = lr * (group["lr"] / base if base else 1.0)
    if hasattr(sched, "base_lrs"):
        sched.base_lrs = [lr] * len(sched.base_lrs)


class Run:
    """One run: the strategy, models, problems and engine, and one method per phase."""

    def __init__(self, config: StrategyConfig, opts: argparse.Namespace) -> None:
        self.config, self.opts, self.out = config, opts, opts.out
        self.strategy = strategy = get_strategy(config)
        self.rank, world = strategy.get_rank(), strategy.world_size
        # data-parallel replicas: the ranks of a sequence-parallel group share their
        # problems (the strategy splits their sequences); at sp_size 1 every rank is one
        self.replicas = max(1, world // config.sp_size)
        self.replica = self.rank * self.replicas // world
        self.group = config.n_samples_per_prompt
        if config.train_batch_size % (self.replicas * self.group):
            raise SystemExit(
                f"train_batch_size={config.train_batch_size} must be a multiple of "
                f"{self.replicas} data-parallel replicas x n_samples_per_prompt={self.group}"
            )
        self.per_replica = config.train_batch_size // self.replicas
        self.train_set, self.held_out = self._problems()
        given = opts.pretrain or config.get_extra_arg("pretrain")
        model_dir = Path(given or self.out / "initial_model")
        if given and not (model_dir / "config.json").is_file():
            raise SystemExit(f"--pretrain {model_dir}: no config.json there; pass a Hugging "
                             "Face model directory (with its tokenizer)")  # fmt: skip
        if not given and self.rank == 0 and not (model_dir / "config.json").exists():
            arithmetic.build_tiny_model(model_dir, config.seed)
        strategy.barrier()
        config.extra_args["pretrain"] = str(model_dir)  # the engine loads the same model
        from transformers import AutoTokenizer
        from transformers.utils import logging as transformers_logging

        if self.rank != 0:  # one rank's progress bars are enough (model loading's too)
            transformers_logging.disable_progress_bar()

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.eos_token_id
        if self.eos is None:
            raise SystemExit(f"the tokenizer of {model_dir} has no eos_token: set one in its "
                             "tokenizer_config.json (completions end at it)")  # fmt: skip
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        actor, reference = _load_model(model_dir), _load_model(model_dir)
        if config.lora_rank > 0:  # --lora_rank N: train a peft LoRA adapter, the base frozen
            from lightrft.strategy.lora import apply_lora

            # peft draws lora_A from torch's generator: seeded here, every rank starts the
            # same adapter whether or not rank 0 has just built the initial model above
            torch.manual_seed(config.seed)
            actor = apply_lora(actor, config)
        self.total = opts.sft_steps + opts.steps
        (self.actor, self.optim, self.sched), _, _, self.reference = (
            strategy.prepare_models_and_optimizers(
                actor, None, None, reference, max_steps=self.total
            )
        )
        strategy.setup_inference_engine(config, actor=self.actor)

    def save_warm_model(self) -> None:
        """The warm-up's result, in Hugging Face format (merged, for a LoRA actor), with
        its tokenizer: ``out/sft_model``, a ``--pretrain`` for later runs and the RL
        phase's reference."""
        self.strategy.save_model(
            self.actor, self.tokenizer, self.out / "sft_model", merge_lora=True
        )

    def adopt_reference(self) -> None:
        """The RL phase's reference model is the warm-up's result (so a resumed RL phase
        gets the same reference back)."""
        self.strategy.load_model(self.reference, self.out / "sft_model", strict=True)

    def _problems(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        opts = self.opts
        if opts.prompts is None:
            return arithmetic.addition_problems(opts.operand_limit, opts.held_out, self.config.seed)
        rows = arithmetic.read_problems(opts.prompts)
        if opts.eval_prompts is not None:
            return rows, arithmetic.read_problems(opts.eval_prompts)
        if not 0 < opts.held_out < len(rows):
            raise SystemExit(f"--held-out {opts.held_out}: {opts.prompts} has {len(rows)} problems")
        return rows[opts.held_out :], rows[: opts.held_out]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def draw(self, step: int, count: int) -> list[dict[str, Any]]:
        """This replica's ``count`` training problems of ``step`` (seeded)."""
        gen = self._generator(step)
        picks = torch.randint(0, len(self.train_set), (count,), generator=gen).tolist()
        return [self.train_set[i] for i in picks]

    def _generator(self, step: int, salt: int = 0) -> torch.Generator:
        seed = self.config.seed * 100_003 + step * 1_009 + self.replica + salt * 7_919
        return torch.Generator().manual_seed(seed)

    def train_rows(self, batch: Batch, loss_of: Any) -> tuple[list[dict[str, float]], float]:
        """Backward and step over micro-batches; ``loss_of(part, start)`` gives a loss and
        its numbers. Returns the numbers of each micro-batch and the seconds taken."""
        t0 = time.perf_counter()
        micro, parts = self.config.micro_train_batch_size, []
        for start in range(0, len(batch.ids), micro):
            part = batch.rows(start, start + micro, self.strategy.device)
            loss, numbers = loss_of(part, start)
            self.strategy.backward(loss, self.actor, self.optim)
            self.strategy.optimizer_step(self.optim, self.actor, self.sched)
            parts.append(numbers)
        return parts, time.perf_counter() - t0

    def sft_step(self, step: int) -> dict[str, Any]:
        """Supervised warm-up: cross-entropy of the answers (and EOS) given the prompts."""
        problems = self.draw(step, self.per_replica)
        draws = torch.rand(len(problems), generator=self._generator(step, salt=7)).tolist()
        rows = [
            (
                self.encode(p["prompt"]),
                [*self.encode(arithmetic.demonstration(p, self.opts.careless_demos, d)), self.eos],
            )
            for p, d in zip(problems, draws, strict=True)
        ]
        batch = Batch(rows, self.pad)

        def loss_of(part: Batch, start: int) -> tuple[torch.Tensor, dict[str, float]]:
            logp, _ = token_logprobs(self.actor, part)
            loss = -masked_mean(logp, part.mask)
            return loss, {"sft_loss": float(loss.detach())}

        parts, train_s = self.train_rows(batch, loss_of)
        return {"phase": "sft", "sft_loss": self._mean(parts, "sft_loss"), "train_s": train_s}

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out problems (each replica grades its share)."""
        self.strategy.update_engine_weights(self.actor)
        mine = self.held_out[self.replica :: self.replicas]
        greedy = SamplingParams(
            max_new_tokens=self.opts.new_tokens, temperature=0, stop_token_ids=(self.eos,)
        )
        outputs = self.strategy.gather_and_generate(
            [self.encode(p["prompt"]) for p in mine], greedy, sleep_engine=True
        )
        right = sum(
            arithmetic.is_correct(self._text(o.output_token_ids), p["answer"])
            for o, p in zip(outputs, mine, strict=True)
        )
        totals = self.strategy.all_reduce(torch.tensor([float(right), float(len(mine))]), op="sum")
        return float(totals[0] / totals[1])

    def _text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def rl_step(self, step: int) -> dict[str, Any]:
        opts, config, group = self.opts, self.config, self.group
        problems = self.draw(step, self.per_replica // group)
        sampling = SamplingParams(
            max_new_tokens=opts.new_tokens,
            temperature=opts.temperature,
            n=group,
            seed=config.seed * 100_003 + step,
            stop_token_ids=(self.eos,),
            logprobs=True,
        )
        # with enable_engine_sleep the engine sleeps while the trainer trains (its memory
        # freed): the sync wakes it (weights, then KV cache), generation sleeps it again
        sync = self.strategy.update_engine_weights(self.actor)
        t0 = time.perf_counter()
        prompts = [self.encode(p["prompt"]) for p in problems]
        outputs = self.strategy.gather_and_generate(prompts, sampling, sleep_engine=True)
        generate_s = time.perf_counter() - t0
        answers = [problems[i // group]["answer"] for i in range(len(outputs))]
        rewards = torch.tensor(
            [
                float(arithmetic.is_correct(self._text(o.output_token_ids), answer))
                for o, answer in zip(outputs, answers, strict=True)
            ]
        )
        advantages = group_advantages(rewards, group)
        batch = Batch(
            [(prompts[i // group], list(o.output_token_ids)) for i, o in enumerate(outputs)],
            self.pad,
        )
        # an engine that returns no log-probs (the fake engine's output rule) gets no
        # mismatch metrics and no correction
        engine_logp = (
            batch.spread([list(o.logprobs) for o in outputs])  # type: ignore[arg-type]
            if all(o.logprobs is not None for o in outputs)
            else None
        )

        def loss_of(part: Batch, start: int) -> tuple[torch.Tensor, dict[str, float]]:
            stop = start + len(part.ids)
            logp, entropy = token_logprobs(self.actor, part, opts.temperature, entropy=True)
            with torch.no_grad():
                ref_logp, _ = token_logprobs(self.reference, part, opts.temperature)
            adv = advantages[start:stop].to(logp.device).unsqueeze(-1)
            weight: torch.Tensor | float = 1.0
            gap: dict[str, float] = {}
            if engine_logp is not None:
                engine = engine_logp[start:stop].to(logp.device)
                gap = logprob_mismatch(engine, logp, part.mask)
                if opts.tis_cap > 0:  # truncated importance sampling: trainer/engine, capped
                    weight = truncated_importance_weights(logp, engine, opts.tis_cap, part.mask)
            log_ratio = ref_logp - logp
            kl = masked_mean(log_ratio.exp() - log_ratio - 1, part.mask)  # k3, >= 0
            # on-policy: the gradient of the clipped ratio at 1 is the gradient of logp
            loss = -masked_mean(weight * adv * logp, part.mask) + opts.kl_coef * kl
            return loss, {
                "loss": float(loss.detach()),
                "kl": float(kl.detach()),
                "entropy": float(masked_mean(entropy, part.mask)),  # type: ignore[arg-type]
                **{k: float(v) for k, v in gap.items() if k != "tokens"},
            }

        parts, train_s = self.train_rows(batch, loss_of)
        generated = sum(len(o.output_token_ids) for o in outputs)
        row = {"phase": "rl", "reward": self._reduce(rewards.mean())}
        for key in ("loss", "kl", "entropy", "logprob_abs_diff", "rollout_kl"):
            if key in parts[0]:
                row[key] = self._mean(parts, key)
        if "logprob_max_abs_diff" in parts[0]:
            row["logprob_max_abs_diff"] = float(
                self.strategy.all_reduce(
                    torch.tensor(max(p["logprob_max_abs_diff"] for p in parts)), op="max"
                )
            )
        row |= {
            "response_length": self._reduce(generated / len(outputs)),
            "tokens_per_s": self._reduce(generated / generate_s) * self.replicas,
            "generate_s": generate_s,
            "train_s": train_s,
            "sync_s": sync["gather_s"] + sync["load_s"],
            "weight_version": sync["weight_version"],
        }
        return row

    def _reduce(self, value: Any) -> float:
        return float(self.strategy.all_reduce(torch.as_tensor(float(value))))

    def _mean(self, parts: list[dict[str, float]], key: str) -> float:
        return self._reduce(sum(p[key] for p in parts) / len(parts))


def _load_model(path: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def train(config: StrategyConfig, opts: argparse.Namespace) -> dict[str, Any]:
    run = Run(config, opts)
    strategy, out = run.strategy, opts.out
    if run.rank == 0:
        sys.stderr.write(
            f"{strategy.backend_name} on {strategy.world_size} ranks, engine "
            f"{config.engine_type}; {ulysses.describe(run.actor)}; {len(run.train_set)} "
            f"training and {len(run.held_out)} held-out problems\n"
        )
    first = 1
    if opts.resume:
        _, client = strategy.load_ckpt(run.actor, out / "checkpoints")
        first = int(client["step"]) + 1
        if client.get("steps", run.total) != run.total and run.rank == 0:
            log.warning(
                "resuming a run of %s steps with %s: the learning-rate schedule now spans %s "
                "steps, so (unless it is constant) the steps after %s differ from either "
                "uninterrupted run",
                client["steps"],
                run.total,
                run.total,
                first - 1,
            )
    tensorboard = config.use_tensorboard
    runlog = RunLog(
        out,
        rank=run.rank,
        steps=run.total,
        first=first,
        tensorboard=tensorboard,
        description="GRPO",
    )
    if first == 1:  # the model as it starts (the warm-up's, with --pretrain and --sft-steps 0)
        runlog.log(0, {"phase": "start", "held_out_accuracy": run.evaluate()})
    if opts.sft_steps and first > opts.sft_steps + 1:  # resumed within the RL phase
        run.adopt_reference()
    last: Path | None = None
    last_step = opts.stop_after or run.total  # parse() keeps it within the total
    for step in range(first, last_step + 1):
        if step > opts.sft_steps:
            if step == opts.sft_steps + 1:  # (a resumed RL phase has it from its checkpoint)
                set_learning_rate(run.optim, run.sched, opts.rl_learning_rate)
                if opts.sft_steps:
                    run.adopt_reference()
            row = run.rl_step(step)
        else:
            row = run.sft_step(step)
        row["lr"] = float(run.sched.get_last_lr()[0])
        rl_done = step - opts.sft_steps
        if (
            step == opts.sft_steps
            or step == run.total
            or (rl_done > 0 and rl_done % opts.eval_every == 0)
        ):
            row["held_out_accuracy"] = run.evaluate()
        runlog.log(step, row)
        if step == opts.sft_steps:
            run.save_warm_model()
        if step % opts.save_every == 0 or step == last_step or step == opts.sft_steps:
            state = {"step": step, "steps": run.total}
            last = strategy.save_ckpt(run.actor, out / "checkpoints", client_state=state)
    runlog.close()
    if run.rank == 0:
        title = f"GRPO on {strategy.backend_name} with the {config.engine_type} engine"
        plot_metrics(read_metrics(out / "metrics.jsonl"), out / "plot.png", PANELS, title=title)
    strategy.close()
    return {"rank": run.rank, "checkpoint": last, "tensorboard": runlog.tensorboard_dir}


def parse(argv: list[str] | None) -> tuple[StrategyConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--config", default=str(HERE / "grpo.yaml"), help="YAML or JSON config")
    add("--sft-steps", type=int, default=150, help="supervised warm-up steps before RL")
    add("--steps", type=int, default=80, help="GRPO steps after the warm-up")
    add("--out", type=Path, default=Path("runs/demo"), help="run directory")
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="stop after step N (warm-up steps count), as an interrupted run would "
        "(checkpoint saved; the schedule still spans every step): --resume continues it",
    )
    add(
        "--pretrain",
        type=Path,
        default=None,
        help="a Hugging Face model directory with its tokenizer (default: build the tiny model)",
    )
    add(
        "--prompts",
        type=Path,
        default=None,
        help="JSONL of {prompt, answer}: the problems (default: the built-in addition task)",
    )
    add("--eval-prompts", type=Path, default=None, help="JSONL of held-out problems")
    add("--held-out", type=int, default=200, help="problems kept aside for evaluation")
    add("--operand-limit", type=int, default=30, help="built-in task: a+b with a, b below this")
    add(
        "--careless-demos",
        type=float,
        default=0.6,
        help="built-in task: share of carrying sums whose warm-up demonstration drops the carry",
    )
    add("--new-tokens", type=int, default=4, help="most tokens per completion")
    add("--temperature", type=float, default=1.0, help="sampling temperature of rollouts")
    add("--rl-learning-rate", type=float, default=2e-4, help="learning rate of the GRPO steps")
    add("--kl-coef", type=float, default=0.0, help="weight of the KL term to the reference")
    add(
        "--tis-cap",
        type=float,
        default=2.0,
        help="truncated importance sampling: weight the loss by min(trainer/engine "
        "probability, cap); 0 turns it off",
    )
    add("--eval-every", type=int, default=20, help="GRPO steps between held-out evaluations")
    add("--save-every", type=int, default=30)
    add(
        "--min-gain",
        type=float,
        default=0.1,
        help="fail (exit 1) unless RL raises held-out accuracy by this much",
    )
    StrategyConfig.add_arguments(parser, suppress_defaults=True)
    given = vars(parser.parse_args(argv))
    names = (
        "config",
        "sft_steps",
        "steps",
        "out",
        "resume",
        "stop_after",
        "pretrain",
        "prompts",
        "eval_prompts",
        "held_out",
        "operand_limit",
        "careless_demos",
        "new_tokens",
        "temperature",
        "rl_learning_rate",
        "kl_coef",
        "tis_cap",
        "eval_every",
        "save_every",
        "min_gain",
    )
    opts = argparse.Namespace(**{n: given.pop(n) for n in names})
    total = opts.sft_steps + opts.steps
    if opts.stop_after is not None and not 1 <= opts.stop_after <= total:
        parser.error(f"--stop-after {opts.stop_after} must be within 1..{total} (all steps)")
    if opts.steps < 0 or opts.sft_steps < 0 or total < 1:
        parser.error("--steps and --sft-steps must be >= 0, and one of them >= 1")
    return StrategyConfig.load(file=opts.config, args=given), opts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        config, opts = parse(argv)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    result = train(config, opts)
    rows = read_metrics(opts.out / "metrics.jsonl")
    if result["rank"] != 0 or not rows:
        return 0
    accuracy = [(r["step"], r["held_out_accuracy"]) for r in rows if "held_out_accuracy" in r]
    before = next((a for s, a in accuracy if s == opts.sft_steps), accuracy[0][1])
    after = accuracy[-1][1]
    where = (
        f"metrics {opts.out / 'metrics.jsonl'}, TensorBoard {result['tensorboard']}, "
        f"plot {opts.out / 'plot.png'}, last checkpoint {result['checkpoint']}"
    )
    print(
        f"held-out accuracy {before:.3f} after the warm-up -> {after:.3f} after RL "
        f"({(after - before) * 100:+.1f} points); {where}"
    )
    if opts.steps == 0 or (opts.stop_after or math.inf) < opts.sft_steps + opts.steps:
        return 0  # a warm-up alone, or an interrupted run (judged when resumed)
    if math.isnan(after) or after - before < opts.min_gain:
        log.error(
            "RL did not raise held-out accuracy: %+.3f < --min-gain %.3f",
            after - before,
            opts.min_gain,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
