"""Benchmark the GRPO demo's RL step against TRL's ``GRPOTrainer`` on the same job.

Both sides run the demo's RL phase (``examples/grpo.py``) on ``--nproc`` CPU processes
(2), fp32, from the same warm-up model: ``--steps`` GRPO steps (80), each rank drawing 16
of the demo's 700 training problems per step and sampling 8 completions of at most 4
tokens each (temperature 1), the demo's exact-match reward, group-normalised
advantages, the seq-mean-token-mean loss (TRL's ``loss_type="grpo"``), no KL term, AdamW
(betas 0.9/0.95, no weight decay) at learning rate 2e-4, constant, gradient clipping at
1.0, one optimizer step per RL step. The settings are the demo's own: the TRL side reads
them from ``examples/grpo.py``'s parser given the flags our side runs with, and builds
its prompts, reward and stop tokens with the demo's helpers (``_trl_side.py``).

* **ours**: ``examples/grpo.py --pretrain WARM --recipe demo --sft-steps 0`` under
  torchrun: FSDP2 on gloo, the HF engine generating on the same ranks (weights synced
  from the trainer each step, the loss weighted by the truncated importance ratio
  trainer/engine, cap 2);
* **trl**: TRL's ``GRPOTrainer`` under torchrun, DDP on gloo (``use_cpu``), generating
  with the training model (no vLLM, so no engine to sync and no importance correction).

First the warm-up model is built once with the demo (``--steps 0``: its ``--sft-steps``
supervised steps, saved as ``sft_model``), unless ``--warm-model`` names one.

**A real model's job** (``--pretrain DIR --prompts FILE [--eval-prompts FILE] [--
grpo.py flags]``): both sides start from that Hugging Face model on those problems
with the demo's ``pretrained`` recipe (learning rate, KL coefficient, completion length
as the README states) and the flags after ``--`` (``--new-tokens 64
--n_samples_per_prompt 4 --train_batch_size 16 --precision bf16``...), each prompt in
the tokenizer's chat template on both sides (TRL is handed the templated text, checked
to tokenize to our side's ids). Our steps without reward signal are skipped (no
backward, no optimizer step) where TRL trains them, so our figure is over the steps
that trained; the report says how many were skipped.

A step's time is the same on both sides: wall clock on rank 0 from the step's start to its
end, the evaluations left out. Ours: around ``Run.step`` (sync, generation, rewards,
advantages, training, the step's metrics), held-out evaluations and checkpoints running
between steps (this benchmark evaluates only before the first step and after the last,
and checkpoints only at the end). TRL: from ``on_step_begin`` to ``on_step_end`` of a
``TrainerCallback`` (generation, rewards, advantages, forward, backward, clipping,
optimizer and scheduler steps); its logging runs after ``on_step_end``. Each side's
figure is the median over its steps (the mean, and the loop's wall time per step with
what runs between steps, are printed beside it). Held-out accuracy: greedy, the demo's 200
held-out problems, at most 4 new tokens, ending at the demo's stop tokens (ours: the
demo's own evaluation; TRL's side: transformers' ``generate`` on the trained model).

The last line sums it up (ratio: ours / trl; below 1 ours is faster):

    vs_trl: ours <s> s/step, trl <s> s/step, ratio <x>, held-out ours <a> trl <a>

Run ``python3 dev.py nox -s bench_trl -- [--steps 80] [--warm-model DIR]`` (the session
installs TRL beside the locked torch and transformers), or from such an environment
``python benchmarks/vs_trl.py``; ``--quick`` runs 3 steps of each side on the real-model
path, with lightrft-testing's tiny chat model and 64 word problems (its figures measure
nothing; ``bench_check`` runs it). A full run took 80 s on an idle 2-core machine
(warm-up 30 s, each side 20-25 s with its start-up); other processes slow it, and the
script says how many CPUs they kept busy during each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from _common import machine_busy_seconds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLES = ROOT / "examples"
OURS_FLAG = "--ours-result"  # vs_trl.py run by torchrun as our side (see run_ours)


def run_ours(result: Path, job: list[str]) -> int:
    """Our side, in one rank under torchrun: examples/grpo.py's ``main`` with each
    ``Run.step`` timed; rank 0 writes the spans to ``result``."""
    sys.path.insert(0, str(EXAMPLES))
    import grpo

    spans: list[dict[str, float]] = []
    step = grpo.Run.step

    def timed_step(self: grpo.Run, number: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        begin = time.perf_counter()
        out = step(self, number)
        spans.append({"step": number, "begin": begin, "end": time.perf_counter()})
        return out

    grpo.Run.step = timed_step  # type: ignore[method-assign, assignment]
    code = grpo.main(job)
    if os.environ.get("RANK", "0") == "0":
        result.write_text(json.dumps(spans) + "\n")
    return code


def torchrun(nproc: int, script: Path, args: Sequence[str], log: Path) -> dict[str, float]:
    """Run ``script`` under torchrun (standalone, ``nproc`` processes, OMP_NUM_THREADS=1
    unless set), its output to ``log``; exits naming the log when it fails. Returns its
    wall seconds and the CPU seconds of the processes it ran and of the whole machine."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(script), *args]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    before, busy0, wall0 = os.times(), machine_busy_seconds(), time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        code = subprocess.run(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode  # fmt: skip
    wall, after, busy1 = time.perf_counter() - wall0, os.times(), machine_busy_seconds()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"{script.name} exited {code}; the end of its log {log}:\n{tail}")
    own = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    busy = (busy1 - busy0) if busy0 is not None and busy1 is not None else None
    return {"wall_s": wall, "own_cpu_s": own, **({"busy_cpu_s": busy} if busy is not None else {})}


def step_figures(spans: list[dict[str, float]]) -> dict[str, float]:
    """Median and mean step seconds, and the loop's wall time per step (first start to
    last end, over the steps: what runs between steps included)."""
    seconds = [s["end"] - s["begin"] for s in spans]
    loop = (spans[-1]["end"] - spans[0]["begin"]) / len(spans)
    return {"median": statistics.median(seconds), "mean": statistics.mean(seconds), "loop": loop}


def mean_of(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def reward_text(rewards: list[float]) -> str:
    """Mean reward over the first and the last ten steps."""
    k = min(10, len(rewards))
    return f"reward {mean_of(rewards[:k]):.3f} (first {k} steps) -> {mean_of(rewards[-k:]):.3f}"


def warm_model(args: argparse.Namespace) -> Path:
    """The warm-up model both sides start from: ``--warm-model``, or the demo's warm-up
    (``--steps 0``) run once here."""
    if args.warm_model is not None:
        if not (args.warm_model / "config.json").is_file():
            sys.exit(f"--warm-model {args.warm_model}: no config.json there")
        return Path(args.warm_model)
    out = args.out / "warm"
    print(f"warm-up: examples/grpo.py --sft-steps {args.sft_steps} --steps 0 ...", flush=True)
    figures = torchrun(
        args.nproc, EXAMPLES / "grpo.py",
        ["--sft-steps", str(args.sft_steps), "--steps", "0", "--out", str(out)],
        args.out / "warm.log",
    )  # fmt: skip
    print(f"  {figures['wall_s']:.0f} s; model {out / 'sft_model'}", flush=True)
    return out / "sft_model"


def quick_job(args: argparse.Namespace) -> None:
    """``--quick``: a tiny chat model (lightrft-testing's, ChatML template) and word
    problems as JSONL files become ``args``' real-model job, at tiny sizes."""
    sys.path.insert(0, str(EXAMPLES))
    import word_problems
    from lightrft.testing.models import save_tiny_chat_model

    folder = args.out / "quick"
    model = save_tiny_chat_model(folder / "model")
    for name, count, seed in (("train", 64, 0), ("eval", 8, 1)):
        rows = word_problems.problems(count, seed)
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = ["--new-tokens", "8", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
             "--micro_train_batch_size", "2"]  # fmt: skip
    args.pretrain, args.job = model, [*sizes, *args.job]
    args.prompts, args.eval_prompts = folder / "train.jsonl", folder / "eval.jsonl"


def job_flags(args: argparse.Namespace, model: Path) -> list[str]:
    """examples/grpo.py's flags for both sides: the demo's RL phase from its warm-up
    model, or (``--pretrain``) a real model's job with its recipe (``pretrained``), its
    problems and the flags given after ``--``."""
    steps = str(args.steps)
    common = ["--sft-steps", "0", "--steps", steps, "--min-gain", "-1", "--eval-every", steps,
              "--save-every", steps]  # fmt: skip
    if args.pretrain is None:
        return ["--pretrain", str(model), "--recipe", "demo", *common, *args.job]
    data = ["--prompts", str(args.prompts)]
    if args.eval_prompts is not None:
        data += ["--eval-prompts", str(args.eval_prompts)]
    return ["--pretrain", str(model), *data, *common, *args.job]


def run_sides(args: argparse.Namespace, job: list[str]) -> dict[str, Any]:
    """Each side once on the same job flags; what each measured."""
    ours_spans, trl_result = args.out / "ours_steps.json", args.out / "trl_result.json"
    found: dict[str, Any] = {}
    print(f"ours: examples/grpo.py {' '.join(job)}", flush=True)
    ours_out = args.out / "ours"
    found["ours_run"] = torchrun(
        args.nproc, Path(__file__).resolve(),
        [OURS_FLAG, str(ours_spans), "--", *job, "--out", str(ours_out)], args.out / "ours.log",
    )  # fmt: skip
    found["ours_spans"] = json.loads(ours_spans.read_text())
    found["ours_rows"] = [
        json.loads(line) for line in (ours_out / "metrics.jsonl").read_text().splitlines()
    ]
    print(f"trl: TRL {metadata.version('trl')} GRPOTrainer on the same job", flush=True)
    found["trl_run"] = torchrun(
        args.nproc, HERE / "_trl_side.py",
        ["--result", str(trl_result), "--", *job, "--out", str(args.out / "trl")],
        args.out / "trl.log",
    )  # fmt: skip
    found["trl"] = json.loads(trl_result.read_text())
    return found


def report(found: dict[str, Any], args: argparse.Namespace, warm: Path) -> str:
    """Print each side's figures; return the summary line. Our steps counted are those
    that trained (a step without reward signal is skipped here, where TRL trains it);
    if none did, every step, said so."""
    rows = found["ours_rows"]
    rl = {r["step"]: r for r in rows if r.get("phase") == "rl"}
    every = [s for s in found["ours_spans"] if s["step"] in rl]
    spans = [s for s in every if not rl[s["step"]].get("skipped")]
    counted = (
        f"{len(spans)} trained RL steps (ours; {len(every) - len(spans)} skipped, no reward signal)"
    )
    if not spans:
        print(f"ours: none of its {len(every)} steps had reward signal (all skipped); "
              "its figures are those of skipped steps")  # fmt: skip
        spans = every
    accuracy = {r["step"]: r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r}
    ours_start, ours_end = accuracy[min(accuracy)], accuracy[max(accuracy)]
    ours = step_figures(spans)

    def part(key: str) -> float:
        return statistics.median(rl[s["step"]].get(key, 0.0) for s in spans)

    ours_parts = {k: part(k) for k in ("sync_s", "generate_s", "train_s")}
    inside = {k: part(k) for k in ("forward_s", "reference_s", "backward_s", "optimizer_s")}
    rest = statistics.median(
        (s["end"] - s["begin"]) - sum(rl[s["step"]].get(k, 0.0) for k in ours_parts) for s in spans
    )
    trl = found["trl"]
    trl_steps = trl["steps"]
    theirs = step_figures(trl_steps)
    generate = statistics.median(s.get("generate_s", 0.0) for s in trl_steps)
    scoring = statistics.median(s.get("rollout_s", 0.0) - s["generate_s"] for s in trl_steps)
    training = statistics.median(s["end"] - s["begin"] - s["rollout_s"] for s in trl_steps)
    problems, group, world = trl["problems_per_rank"], trl["group"], trl["world"]
    print(
        f"job: {world} ranks x {problems} problems x {group} completions per step, "
        f"{counted} / {len(trl_steps)} (trl, every step trains), from {warm}"
    )
    print(
        f"ours (FSDP2 + HF engine on the same ranks): median {ours['median']:.4f} s/step "
        f"(mean {ours['mean']:.4f}, loop {ours['loop']:.4f}); medians: sync "
        f"{ours_parts['sync_s']:.4f}, generate {ours_parts['generate_s']:.4f}, train "
        f"{ours_parts['train_s']:.4f} (forward {inside['forward_s']:.4f}, reference "
        f"{inside['reference_s']:.4f}, backward {inside['backward_s']:.4f}, optimizer "
        f"{inside['optimizer_s']:.4f}), rest {rest:.4f} s"
    )
    print(
        f"  {reward_text([rl[s['step']]['reward'] for s in spans])}; held-out "
        f"{ours_start:.3f} -> {ours_end:.3f}; run {found['ours_run']['wall_s']:.0f} s"
    )
    print(
        f"trl {metadata.version('trl')} ({trl['ddp']} on {trl['backend']}, generating with the "
        f"training model): median {theirs['median']:.4f} s/step (mean {theirs['mean']:.4f}, "
        f"loop {theirs['loop']:.4f}); medians: generate {generate:.4f}, rewards and advantages "
        f"{scoring:.4f}, train {training:.4f} s"
    )
    print(
        f"  {reward_text([s.get('reward', float('nan')) for s in trl_steps])}; held-out "
        f"{trl['held_out_start']:.3f} -> {trl['held_out_end']:.3f}; run "
        f"{found['trl_run']['wall_s']:.0f} s"
    )
    for side in ("ours_run", "trl_run"):
        run = found[side]
        if "busy_cpu_s" in run:
            others = max(0.0, run["busy_cpu_s"] - run["own_cpu_s"]) / run["wall_s"]
            noisy = ": its figures are noisy" if others > 0.25 else ""
            print(
                f"other processes kept {others:.2f} of {os.cpu_count()} CPUs busy on average "
                f"during {side.removesuffix('_run')}'s run{noisy}"
            )
    return (
        f"vs_trl: ours {ours['median']:.3f} s/step, trl {theirs['median']:.3f} s/step, ratio "
        f"{ours['median'] / theirs['median']:.2f}, held-out ours {ours_end:.3f} trl "
        f"{trl['held_out_end']:.3f}"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == [OURS_FLAG]:  # our side, inside torchrun
        job = argv[2:]
        return run_ours(Path(argv[1]), job[1:] if job[:1] == ["--"] else job)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80, help="RL steps per side")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) per side")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "vs_trl", help="run folder")
    parser.add_argument(
        "--warm-model", type=Path, default=None,
        help="the warm-up model (a Hugging Face model directory with its tokenizer, as the "
        "demo's sft_model); default: build it with the demo's warm-up",
    )  # fmt: skip
    parser.add_argument("--sft-steps", type=int, default=150, help="warm-up steps when building")
    parser.add_argument(
        "--pretrain", type=Path, default=None,
        help="a real model's job instead of the demo's: this Hugging Face model directory "
        "(with its tokenizer; its chat template on both sides) on --prompts, the demo's "
        "pretrained recipe, the flags after -- on both sides",
    )  # fmt: skip
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL of problems (--pretrain)")
    parser.add_argument(
        "--eval-prompts", type=Path, default=None,
        help="JSONL of held-out problems (--pretrain; default: the demo's --held-out of --prompts)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke check: 3 RL steps per side on a tiny chat model (lightrft-testing's) and "
        "word problems, the real-model job's path (figures measure nothing)",
    )  # fmt: skip
    # after --: examples/grpo.py flags for both sides (--new-tokens 64 --precision bf16 ...)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if extra else 0)])
    args.job = extra
    if args.quick:
        args.steps = 3
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if (args.pretrain is None) != (args.prompts is None) and not args.quick:
        parser.error("--pretrain and --prompts go together (a real model's job)")
    args.out = args.out.resolve()
    if args.quick and args.pretrain is None:
        quick_job(args)
    if args.pretrain is not None:
        if not (args.pretrain / "config.json").is_file():
            sys.exit(f"--pretrain {args.pretrain}: no config.json there")
        warm = args.pretrain.resolve()
    else:
        warm = warm_model(args).resolve()
    found = run_sides(args, job_flags(args, warm))
    line = report(found, args, warm)
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
