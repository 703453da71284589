"""A small end-to-end training run on CPU, configured by lightrft.config.

A two-layer causal transformer learns a token-id task (each next token is the
previous one plus one, modulo the vocabulary) in a few seconds. Configuration is
layered exactly as in a real trainer: examples/tiny.yaml < LIGHTRFT_* environment
variables < command-line flags.

    python examples/train_tiny.py --steps 60 --zero_stage 3 --seed 7

The loop applies the StrategyConfig semantics one process at a time (gradient
accumulation from the world size, global-norm clipping, AdamW with the configured
betas and weight decay, warmup then cosine decay). It uses plain PyTorch until the
strategy backends exist; then it will call `get_strategy(config)` instead.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightrft.config import ConfigError, StrategyConfig

log = logging.getLogger("train_tiny")
HERE = Path(__file__).parent


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, ctx: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        hidden = self.blocks(self.embed(ids) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(hidden)


def batch(generator: torch.Generator, size: int, vocab: int, length: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    return (start + torch.arange(length)) % vocab


def warmup_cosine(step: int, total: int, warmup_ratio: float) -> float:
    warmup = max(1, math.ceil(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(config: StrategyConfig, steps: int, vocab: int = 64, length: int = 16) -> float:
    torch.manual_seed(config.seed)
    data = torch.Generator().manual_seed(config.seed)
    accumulation = config.gradient_accumulation_steps(world_size=1)
    model = TinyCausalLM(vocab)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.actor_learning_rate,
        betas=config.adam_betas,
        weight_decay=config.l2,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, steps, config.lr_warmup_ratio)
    )
    log.info("%s", config.summary())
    log.info(
        "training %d steps: %d micro-batches of %d per step (global batch %d)",
        steps,
        accumulation,
        config.micro_train_batch_size,
        config.train_batch_size,
    )
    first_loss = last_loss = float("nan")
    started = time.perf_counter()
    for step in range(steps):
        total = 0.0
        for _ in range(accumulation):
            ids = batch(data, config.micro_train_batch_size, vocab, length)
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
            (loss / accumulation).backward()
            total += loss.item() / accumulation
        if config.max_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), config.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        first_loss = total if step == 0 else first_loss
        last_loss = total
        if step % 10 == 0 or step == steps - 1:
            log.info(
                "step %3d/%d  loss %.4f  lr %.2e", step + 1, steps, total, schedule.get_last_lr()[0]
            )
    with torch.no_grad():
        ids = batch(data, 64, vocab, length)
        accuracy = (model(ids[:, :-1]).argmax(-1) == ids[:, 1:]).float().mean().item()
    log.info(
        "done in %.1fs: loss %.4f -> %.4f, next-token accuracy %.1f%%",
        time.perf_counter() - started,
        first_loss,
        last_loss,
        100 * accuracy,
    )
    return accuracy


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(HERE / "tiny.yaml"), help="YAML or JSON config")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="fail below this")
    StrategyConfig.add_arguments(parser, suppress_defaults=True)
    given = vars(parser.parse_args(argv))
    file, steps, min_accuracy = given.pop("config"), given.pop("steps"), given.pop("min_accuracy")
    try:
        config = StrategyConfig.load(file=file, args=given)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    accuracy = train(config, steps)
    if accuracy < min_accuracy:
        log.error("the model did not learn: accuracy %.3f < %.3f", accuracy, min_accuracy)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
