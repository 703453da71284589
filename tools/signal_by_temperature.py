"""How much reward signal a GRPO step would get from a model, by sampling temperature.

GRPO learns only from groups whose completions are not all right or all wrong (an
all-equal group's advantages are 0). This samples ``--group`` completions for each of
``--problems`` problems through the model's chat template at each ``--temperatures``
value (transformers' ``generate``, the demo's ``--new-tokens`` cap and its reward: the
completion's last integer is the answer) and prints, per temperature, the fraction of
completions that are right, the fraction of groups with signal, and how many hit the
token cap. No training: it measures the recipe's sampling choice before a run.

    .nox/demo/bin/python tools/signal_by_temperature.py MODEL_DIR PROBLEMS.jsonl \\
        [--problems 32] [--group 8] [--new-tokens 96] [--temperatures 1.0 0.7 0.5]
        [--system-prompt TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from arithmetic import is_correct  # (the demo's reward)
from prompting import PromptEncoder, stop_ids  # (the demo's prompts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.5])
    parser.add_argument("--system-prompt", default=None, help="as the demo's flag")
    parser.add_argument("--batch", type=int, default=64, help="rows per generate call")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32).eval()
    encoder = PromptEncoder(tokenizer, system_prompt=opts.system_prompt)
    stops = list(stop_ids(tokenizer, opts.model))
    lines = opts.prompts.read_text().splitlines()[: opts.problems]
    problems = [json.loads(line) for line in lines if line.strip()]
    texts = [encoder.text(p["prompt"]) for p in problems for _ in range(opts.group)]
    print(f"{len(problems)} problems x {opts.group} completions, at most {opts.new_tokens} tokens")
    print("temperature | right | groups with signal | at the cap | seconds")
    for temperature in opts.temperatures:
        torch.manual_seed(opts.seed)
        right, capped, start = [], 0, time.perf_counter()
        for first in range(0, len(texts), opts.batch):
            batch = tokenizer(texts[first : first + opts.batch], return_tensors="pt",
                              padding=True, add_special_tokens=False)  # fmt: skip
            with torch.no_grad():
                out = model.generate(
                    **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                    max_new_tokens=opts.new_tokens, eos_token_id=stops,
                    pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
            for k, row in enumerate(out[:, batch.input_ids.shape[1] :].tolist()):
                ended = next((j for j, t in enumerate(row) if t in stops), None)
                capped += ended is None
                text = str(tokenizer.decode(row[:ended], skip_special_tokens=True))
                answer = problems[(first + k) // opts.group]["answer"]
                right.append(is_correct(text, int(answer)))
        groups = [right[i : i + opts.group] for i in range(0, len(right), opts.group)]
        signal = sum(0 < sum(g) < len(g) for g in groups) / len(groups)
        print(f"{temperature:11g} | {sum(right) / len(right):5.3f} | {signal:18.3f} | "
              f"{capped / len(right):10.3f} | {time.perf_counter() - start:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
