"""Simple arithmetic word problems with integer answers, as JSONL for ``--prompts``.

One-step and two-step addition and subtraction with small numbers (``Anna has 12
apples. She buys 5 more. How many apples does she have now?``), with the names, objects
and verbs drawn at random; no answer is negative. Each line is ``{"prompt": ...,
"answer": <int>}``, the format ``arithmetic.read_problems`` reads. The same seed gives
the same file.

    python examples/word_problems.py problems.jsonl --count 250 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [("Anna", "she"), ("Ben", "he"), ("Carla", "she"), ("David", "he"), ("Emma", "she"),
         ("Omar", "he"), ("Lena", "she"), ("Sam", "he"), ("Mia", "she"), ("Tom", "he")]  # fmt: skip
OBJECTS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards"]
GAINS = ["buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more"]
LOSSES = ["gives away {n}", "loses {n}", "sells {n}", "gives {n} to a friend"]


def step(rng: random.Random, total: int, limit: int) -> tuple[str, int]:
    """One change to ``total``: (the verb phrase, the signed amount); never below zero."""
    if total > 1 and rng.random() < 0.5:
        n = rng.randint(1, total - 1)
        return rng.choice(LOSSES).format(n=n), -n
    n = rng.randint(1, limit)
    return rng.choice(GAINS).format(n=n), n


def problem(rng: random.Random, limit: int = 20) -> dict[str, object]:
    """One problem: a starting count, then one or two changes, or two people's counts
    put together."""
    (name, pronoun), things = rng.choice(NAMES), rng.choice(OBJECTS)
    start = rng.randint(2, limit)
    kind = rng.choice(["one", "two", "together"])
    if kind == "together":
        other = rng.choice([n for n, _ in NAMES if n != name])
        more = rng.randint(1, limit)
        text = (f"{name} has {start} {things} and {other} has {more} {things}. "
                f"How many {things} do they have together?")  # fmt: skip
        return {"prompt": text, "answer": start + more}
    first, delta = step(rng, start, limit)
    text, total = f"{name} has {start} {things}. {pronoun.capitalize()} {first}", start + delta
    if kind == "two":
        second, delta = step(rng, total, limit)
        text, total = f"{text}, then {pronoun} {second}", total + delta
    question = f"How many {things} does {pronoun} have now?"
    return {"prompt": f"{text}. {question}", "answer": total}


def problems(count: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = problems(args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
