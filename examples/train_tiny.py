"""A small end-to-end training run on CPU, through a LightRFT strategy.

A two-layer causal transformer (``lightrft.testing.models.TinyCausalLM``) learns a
token-id task (each next token is the previous one plus one, modulo the vocabulary) in
seconds. The configuration is layered as in a
real trainer (examples/tiny.yaml < LIGHTRFT_* environment < flags), the strategy comes
from `get_strategy(config)` (FSDP2 by default), and the run ends with a resumable
checkpoint and a Hugging Face-format export under --out.

    python examples/train_tiny.py --steps 60 --seed 7
    torchrun --nproc-per-node 2 examples/train_tiny.py        # the same on 2 ranks
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from lightrft.config import ConfigError, StrategyConfig
from lightrft.strategy import get_strategy
from lightrft.testing.models import TinyCausalLM

log = logging.getLogger("train_tiny")
HERE = Path(__file__).parent


class NextTokenTask(Dataset[torch.Tensor]):
    """Sequences start at a random token and count up modulo the vocabulary."""

    def __init__(self, size: int, vocab: int, length: int, seed: int) -> None:
        starts = torch.randint(0, vocab, (size, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


def train(
    config: StrategyConfig, steps: int, out: Path, vocab: int = 64, length: int = 16
) -> float:
    strategy = get_strategy(config)
    config.log_summary(rank=strategy.get_rank())
    (model, optim, sched), *_ = strategy.prepare_models_and_optimizers(
        TinyCausalLM(vocab, dim=64, layers=2, heads=4, max_len=length),
        None,
        None,
        None,
        None,
        max_steps=steps,
    )
    loader = strategy.setup_dataloader(NextTokenTask(4096, vocab, length, config.seed))
    strategy.print(
        f"{strategy.backend_name} on {strategy.world_size} rank(s), {strategy.device}: "
        f"{steps} steps of {config.train_batch_size} samples, "
        f"{strategy.accumulated_gradient} micro-batch(es) of "
        f"{config.micro_train_batch_size} per rank"
    )
    started = time.perf_counter()
    batches = iter(loader)
    first_loss = last_loss = float("nan")
    while strategy.step_state(model).global_steps < steps:
        ids = next(batches)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        strategy.backward(loss, model, optim)
        if strategy.optimizer_step(optim, model, sched):
            step = strategy.step_state(model).global_steps
            last_loss = float(strategy.all_reduce(loss.detach()))
            first_loss = last_loss if step == 1 else first_loss
            if step % 10 == 0 or step in (1, steps):
                lr = sched.get_last_lr()[0]
                strategy.print(f"step {step:3d}/{steps}  loss {last_loss:.4f}  lr {lr:.2e}")
    model.eval()
    with torch.no_grad():
        ids = NextTokenTask(64, vocab, length, config.seed + 1).ids
        hits = (model(ids[:, :-1]).argmax(-1) == ids[:, 1:]).float().mean()
    accuracy = float(strategy.all_reduce(hits))
    checkpoint = strategy.save_ckpt(model, out / "checkpoints")
    strategy.save_model(model, None, out / "model")
    strategy.print(
        f"done in {time.perf_counter() - started:.1f}s: loss {first_loss:.4f} -> {last_loss:.4f}, "
        f"next-token accuracy {100 * accuracy:.1f}%; checkpoint {checkpoint}, "
        f"HF export {out / 'model'}"
    )
    strategy.close()
    return accuracy


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(HERE / "tiny.yaml"), help="YAML or JSON config")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="fail below this")
    parser.add_argument("--out", type=Path, default=Path("runs/tiny"), help="output directory")
    StrategyConfig.add_arguments(parser, suppress_defaults=True)
    given = vars(parser.parse_args(argv))
    file, steps, out = given.pop("config"), given.pop("steps"), given.pop("out")
    min_accuracy = given.pop("min_accuracy")
    try:
        config = StrategyConfig.load(file=file, args=given)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    accuracy = train(config, steps, out)
    if accuracy < min_accuracy:
        log.error("the model did not learn: accuracy %.3f < %.3f", accuracy, min_accuracy)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
