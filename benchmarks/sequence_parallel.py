"""Benchmark Ulysses sequence parallelism against the plain model, same global batch.

Two ranks, a global batch of ``--rows`` rows trained one row per micro-step on each
data-parallel replica (``micro_train_batch_size`` 1). The raw side is transformers'
Qwen2 as it is, at sp_size 1: two replicas, each rank computes its own rows whole. Our
side is the same model with ``lightrft.strategy.ulysses`` applied over the 2 ranks, at
sp_size 2: one replica, both ranks hold the same rows (as the strategy's loader gives
them) and compute each row together, half of the sequence each, in twice as many
micro-steps. Both sides accumulate gradients over their micro-steps and all-reduce them
(the data-parallel sync), interleaved over rounds, for each sequence length. Printed:

* activation memory per rank, the peak over micro-steps: on CPU the bytes autograd
  saves for backward during a forward and the log-probabilities
  (``saved_tensors_hooks``, each storage once), on CUDA the peak allocated during a
  micro-step minus what was allocated before it. Both sides compute the loss with
  ``lightrft.strategy.packing.token_logprobs`` (every token after the first is a loss
  token): at sp_size 2 each rank runs the language-model head on its own slice of the
  sequence and the per-token log-probabilities are gathered, not the hidden states;
* tokens/s: the global batch's tokens over the slower rank's seconds;
* the share of our side's time spent in the all-to-all exchanges.

    python benchmarks/sequence_parallel.py [--lengths 512 1024 2048 4096] [--rows 2]

re-launches itself under torchrun with 2 processes (gloo on CPU; ``--device cuda`` uses
NCCL and needs 2 GPUs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from _common import relaunch_under_torchrun, under_torchrun


def _model(args: argparse.Namespace) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    fields: dict[str, Any] = {
        "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(args.lengths), "attn_implementation": "sdpa",
    }  # fmt: skip
    config = Qwen2Config(**fields)
    return Qwen2ForCausalLM(config).to(args.device)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward (each storage once)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


def _step(model: Any, rows: list[torch.Tensor], device: str) -> tuple[float, int]:
    """Forward + backward of each row (one micro-step each), then the gradient
    all-reduce: (seconds of the slower rank, peak activation bytes of a micro-step)."""
    from lightrft.strategy.packing import build_batch, token_logprobs

    model.zero_grad(set_to_none=True)
    dist.barrier()
    peak = 0
    start = time.perf_counter()
    for ids in rows:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        saved = _SavedBytes()
        # every token after the first is a loss token; token_logprobs runs the LM head
        # on those only (at sp_size 2: each rank on its slice, log-probs gathered)
        batch = build_batch([(ids[0, :1].tolist(), ids[0, 1:].tolist())], [0], packed=True)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            logp, _ = token_logprobs(model, batch.to(ids.device))
            loss = -logp.mean()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - before)
        else:
            peak = max(peak, saved.bytes)
    for param in model.parameters():
        dist.all_reduce(param.grad)
    if device == "cuda":
        torch.cuda.synchronize()
    times = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
    return float(times), peak


def _exchange_timer() -> list[float]:
    """Time spent in the Ulysses all-to-all (forward and backward), on this rank."""
    from lightrft.strategy import sequence_parallel

    spent = [0.0]
    inner = sequence_parallel._all_to_all

    def timed(*args: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            spent[0] += time.perf_counter() - start

    sequence_parallel._all_to_all = timed  # type: ignore[assignment]
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--rows", type=int, default=2, help="rows of the global batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if not under_torchrun():
        return relaunch_under_torchrun(__file__, 2)

    from lightrft.strategy import ulysses

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    raw = _model(args)
    ours = ulysses.apply_ulysses(_model(args), dist.group.WORLD)
    exchanged = _exchange_timer()
    if args.rows % world:
        raise SystemExit(f"--rows {args.rows} must be a multiple of the {world} ranks")
    if rank == 0:
        print(f"Qwen2 {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
              f"({args.kv_heads} key-value), vocab {args.vocab}; {args.rows} rows on {world} "
              f"ranks ({args.device}), one row per micro-step; median of {args.rounds} "
              "rounds")  # fmt: skip
        print(f"{'length':>7} | {'act MiB sp1':>11} {'sp2':>7} {'ratio':>6} | "
              f"{'tok/s sp1':>9} {'sp2':>7} {'ratio':>6} | all-to-all share")  # fmt: skip
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        batch = torch.randint(0, args.vocab, (args.rows, 1, length), generator=generator)
        batch = batch.to(args.device)
        own = list(batch[rank::world])  # sp_size 1: this replica's rows
        shared = list(batch)  # sp_size 2: the one replica's rows, on both ranks
        _step(raw, own, args.device), _step(ours, shared, args.device)  # warm-up
        sides: dict[str, list[tuple[float, int]]] = {"raw": [], "ours": []}
        shares = []
        for round_ in range(args.rounds):
            order = ("raw", "ours") if round_ % 2 == 0 else ("ours", "raw")
            for side in order:
                before = exchanged[0]
                result = (
                    _step(raw, own, args.device)
                    if side == "raw"
                    else (_step(ours, shared, args.device))
                )
                sides[side].append(result)
                if side == "ours":
                    shares.append((exchanged[0] - before) / result[0])
        t_raw = statistics.median(s for s, _ in sides["raw"])
        t_ours = statistics.median(s for s, _ in sides["ours"])
        m_raw, m_ours = sides["raw"][-1][1], sides["ours"][-1][1]
        tokens = args.rows * length
        if rank == 0:
            print(f"{length:>7} | {m_raw / 2**20:>11.1f} {m_ours / 2**20:>7.1f} "
                  f"{m_ours / m_raw:>6.2f} | {tokens / t_raw:>9.0f} {tokens / t_ours:>7.0f} "
                  f"{t_raw / t_ours:>6.2f} | {statistics.median(shares):.0%}")  # fmt: skip
            sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
