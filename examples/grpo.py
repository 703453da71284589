"""GRPO on CPU: a trainer and a rollout engine sharing the machine, end to end.

A tiny random causal LM (a Qwen2 built from a config: no download) learns, by
reinforcement, to answer prompts with tokens from a target set (ids below
``--target-ids``); the reward of a completion is the fraction of its tokens in the set,
so it starts near ``target_ids / vocab`` and can reach 1. Each step:

1. the policy's current weights go to the engine (``strategy.update_engine_weights``;
   syncing before generating, not after training, also serves an engine whose
   level-2 sleep discarded its weights);
2. every rank draws its prompts (seeded by step and rank) and the engine generates
   ``n_samples_per_prompt`` completions per prompt (``strategy.gather_and_generate``);
3. advantages are the rewards normalised within each prompt's group (GRPO);
4. the policy-gradient loss plus ``--kl-coef`` times a KL estimate to the frozen
   reference model is backpropagated (``strategy.backward`` / ``optimizer_step``).

Only the public API is used, so the same file runs on every strategy and engine the
configuration selects (``--backend fsdp2|deepspeed|fake``, ``--zero_stage``,
``--engine_type hf|vllm|fake``, ``--device``). The run directory (``--out``) gets
``metrics.jsonl`` (one line per step), ``plot.png`` (reward and KL per step) and
rotated checkpoints; ``--resume`` continues from the latest checkpoint and gives the
same per-step metrics as an uninterrupted run (``--stop-after N`` stops a run after
step N as an interruption would; the learning-rate schedule still spans ``--steps``).

``--lora_rank N`` (with ``--lora_alpha``, ``--target_modules``) trains a peft LoRA
adapter instead of every weight; the engine receives the merged weights, or with
``--lora_sync adapter`` (vLLM, SGLang) the adapter alone.

    torchrun --nproc-per-node 2 examples/grpo.py            # the default: 2 ranks, FSDP2, HF
    python examples/grpo.py --backend fake --engine_type fake --steps 5
"""

from __future__ import annotations

import argparse
import json
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

HERE = Path(__file__).parent
log = logging.getLogger("grpo")

#: The tiny model's config (head_dim 64: vLLM's CPU kernels need at least that).
MODEL: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "eos_token_id": None, "bos_token_id": None,
}  # fmt: skip


def build_initial_model(path: Path, seed: int) -> None:
    """Save a random tiny Qwen2 with ``save_pretrained`` (the engine loads it from disk)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**MODEL)).save_pretrained(path)


def load_model(path: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def token_logprobs(model: Any, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities the model gives each completion token (batch, new tokens)."""
    logits = model(input_ids=sequences).logits[:, prompt_len - 1 : -1].float()
    targets = sequences[:, prompt_len:].unsqueeze(-1)
    return logits.log_softmax(-1).gather(-1, targets).squeeze(-1)


def rewards_of(completions: torch.Tensor, target_ids: int) -> torch.Tensor:
    """The verifiable reward: the fraction of a completion's tokens below ``target_ids``."""
    return (completions < target_ids).float().mean(-1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: each reward minus its prompt group's mean, over the group's std."""
    grouped = rewards.view(-1, group)
    normalised = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)
    return normalised.view(-1)


def train(config: StrategyConfig, opts: argparse.Namespace) -> dict[str, Any]:
    out: Path = opts.out
    strategy = get_strategy(config)
    rank, world = strategy.get_rank(), strategy.world_size
    # data-parallel replicas: the ranks of a sequence-parallel group share their prompts
    # (and the strategy splits their sequences); at sp_size 1 every rank is one
    # (a simulated sp_size, as the fake strategy's, leaves one replica)
    replicas = max(1, world // config.sp_size)
    replica = rank * replicas // world
    group = config.n_samples_per_prompt
    if config.train_batch_size % (replicas * group):
        raise SystemExit(
            f"train_batch_size={config.train_batch_size} must be a multiple of "
            f"{replicas} data-parallel replicas x n_samples_per_prompt={group}"
        )
    prompts_per_rank = config.train_batch_size // (replicas * group)
    model_dir = Path(config.get_extra_arg("pretrain") or out / "initial_model")
    if rank == 0 and not (model_dir / "config.json").exists():
        build_initial_model(model_dir, config.seed)
    strategy.barrier()
    config.extra_args["pretrain"] = str(model_dir)  # the engine loads the same model

    actor, reference = load_model(model_dir), load_model(model_dir)
    if config.lora_rank > 0:  # --lora_rank N: train a peft LoRA adapter, the base frozen
        from lightrft.strategy.lora import apply_lora

        # peft draws lora_A from torch's generator: seeded here, every rank starts the
        # same adapter whether or not rank 0 has just built the initial model above
        torch.manual_seed(config.seed)
        actor = apply_lora(actor, config)
    (actor, optim, sched), _, _, reference = strategy.prepare_models_and_optimizers(
        actor, None, None, reference, max_steps=opts.steps
    )
    strategy.setup_inference_engine(config, actor=actor)
    if rank == 0:
        sys.stderr.write(f"{strategy.backend_name} on {world} ranks; {ulysses.describe(actor)}\n")
    first = 1
    metrics_file = out / "metrics.jsonl"
    if opts.resume:
        _, client = strategy.load_ckpt(actor, out / "checkpoints")
        first = int(client["step"]) + 1
        if client.get("steps", opts.steps) != opts.steps and rank == 0:
            log.warning(
                "resuming a run of --steps %s with --steps %s: the learning-rate schedule now "
                "spans %s steps, so (unless it is constant) the steps after %s differ from "
                "either uninterrupted run", client["steps"], opts.steps, opts.steps, first - 1,
            )  # fmt: skip
        if rank == 0:  # forget steps after the checkpoint
            kept = metrics_file.read_text().splitlines()[: first - 1]
            metrics_file.write_text("".join(line + "\n" for line in kept))
    elif rank == 0:
        metrics_file.write_text("")
    vocab, prompt_len = MODEL["vocab_size"], opts.prompt_len
    history: list[dict[str, Any]] = []
    last: Path | None = None
    last_step = opts.stop_after or opts.steps  # parse() keeps it within --steps
    for step in range(first, last_step + 1):
        gen = torch.Generator().manual_seed(config.seed * 100_003 + step * 1_009 + replica)
        prompts = torch.randint(0, vocab, (prompts_per_rank, prompt_len), generator=gen)
        sampling = SamplingParams(
            max_new_tokens=opts.new_tokens, temperature=1.0, n=group,
            seed=config.seed * 100_003 + step,
        )  # fmt: skip
        # with enable_engine_sleep the engine sleeps while the trainer trains (its memory
        # freed): the sync wakes it (weights, then KV cache), generation sleeps it again
        sync = strategy.update_engine_weights(actor)
        t0 = time.perf_counter()
        outputs = strategy.gather_and_generate(prompts.tolist(), sampling, sleep_engine=True)
        generate_s = time.perf_counter() - t0
        completions = torch.tensor([o.output_token_ids for o in outputs])
        sequences = torch.cat([prompts.repeat_interleave(group, 0), completions], dim=1)
        rewards = rewards_of(completions, opts.target_ids)
        advantages = group_advantages(rewards, group)

        t0 = time.perf_counter()
        micro = config.micro_train_batch_size
        losses, kls = [], []
        for start in range(0, len(sequences), micro):
            batch = sequences[start : start + micro].to(strategy.device)
            adv = advantages[start : start + micro].to(strategy.device).unsqueeze(-1)
            logp = token_logprobs(actor, batch, prompt_len)
            with torch.no_grad():
                ref_logp = token_logprobs(reference, batch, prompt_len)
            log_ratio = ref_logp - logp
            kl = (log_ratio.exp() - log_ratio - 1).mean()  # k3, >= 0
            # on-policy: the gradient of the clipped ratio at 1 is the gradient of logp
            loss = -(adv * logp).mean() + opts.kl_coef * kl
            strategy.backward(loss, actor, optim)
            strategy.optimizer_step(optim, actor, sched)
            losses.append(float(loss.detach()))
            kls.append(float(kl.detach()))
        train_s = time.perf_counter() - t0
        row = {
            "step": step,
            "reward_mean": float(strategy.all_reduce(rewards.mean())),
            "kl": float(strategy.all_reduce(sum(kls) / len(kls))),
            "loss": float(strategy.all_reduce(sum(losses) / len(losses))),
            "lr": sched.get_last_lr()[0],
            "generate_s": round(generate_s, 4),
            "train_s": round(train_s, 4),
            "sync_s": round(sync["gather_s"] + sync["load_s"], 4),
            "weight_version": sync["weight_version"],
        }
        history.append(row)
        if rank == 0:
            with metrics_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            _progress(row, opts.steps)
        if step % opts.save_every == 0 or step == last_step:
            state = {"step": step, "steps": opts.steps}
            last = strategy.save_ckpt(actor, out / "checkpoints", client_state=state)
    if rank == 0:
        sys.stderr.write("\n")
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        from plot_png import plot_metrics

        plot_metrics(rows, out / "plot.png")
    strategy.close()
    return {"history": history, "rank": rank, "checkpoint": last}


def _progress(row: dict[str, Any], steps: int) -> None:
    done = int(30 * row["step"] / steps)
    bar = "#" * done + "." * (30 - done)
    sys.stderr.write(
        f"\r[{bar}] step {row['step']}/{steps}  reward {row['reward_mean']:.3f}  "
        f"kl {row['kl']:.4f}  sync {row['sync_s'] * 1000:.0f} ms"
    )
    sys.stderr.flush()


def parse(argv: list[str] | None) -> tuple[StrategyConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(HERE / "grpo.yaml"), help="YAML or JSON config")
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--stop-after", type=int, default=None, metavar="N",
        help="stop after step N, as an interrupted run would (checkpoint saved; the schedule "
        "still spans --steps): --resume continues it",
    )  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--target-ids", type=int, default=8, help="reward: tokens below this id")
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--min-gain", type=float, default=0.2,
        help="fail (exit 1) unless the mean reward of the last 5 steps beats the first 5 by this",
    )  # fmt: skip
    StrategyConfig.add_arguments(parser, suppress_defaults=True)
    given = vars(parser.parse_args(argv))
    names = ("config", "steps", "out", "resume", "stop_after", "prompt_len", "new_tokens",
             "target_ids", "kl_coef", "save_every", "min_gain")  # fmt: skip
    opts = argparse.Namespace(**{n: given.pop(n) for n in names})
    if opts.stop_after is not None and not 1 <= opts.stop_after <= opts.steps:
        parser.error(f"--stop-after {opts.stop_after} must be within 1..--steps ({opts.steps})")
    return StrategyConfig.load(file=opts.config, args=given), opts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sys.path.insert(0, str(HERE))  # plot_png
    try:
        config, opts = parse(argv)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    result = train(config, opts)
    rows = [json.loads(line) for line in (opts.out / "metrics.jsonl").read_text().splitlines()]
    if result["rank"] != 0 or not rows:
        return 0
    head = sum(r["reward_mean"] for r in rows[:5]) / len(rows[:5])
    tail = sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:])
    print(
        f"reward {head:.3f} (first 5 steps) -> {tail:.3f} (last 5); "
        f"metrics {opts.out / 'metrics.jsonl'}, plot {opts.out / 'plot.png'}, "
        f"last checkpoint {result['checkpoint']}"
    )
    if math.isnan(tail) or tail - head < opts.min_gain:
        log.error("the policy did not learn: reward gain %.3f < --min-gain %.3f", tail - head,
                  opts.min_gain)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
