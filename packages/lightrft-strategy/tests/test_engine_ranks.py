"""Engine ranks of their own (engine_placement: separate): a 3-rank job, 2 trainer
ranks on FSDP2 and 1 engine rank serving the Hugging Face engine, over real gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.testing.launcher import RankFailure, run_distributed
from lightrft.testing.models import tiny_hf_causal_lm

from . import engine_rank_workers as workers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_lm")
    torch.manual_seed(0)
    tiny_hf_causal_lm().save_pretrained(path)
    return str(path)


def _reference_outputs(model_dir: str, prompts: list[list[int]], sampling: Any) -> list[Any]:
    """The HF engine in this process, on every trainer's prompts in one call."""
    from lightrft.engines import build_engine

    engine = build_engine(
        {"engine_type": "hf", "pretrain": model_dir, "device": "cpu", "precision": "fp32"}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1): the same rounding
    try:
        return list(engine.generate(prompts, sampling))
    finally:
        torch.set_num_threads(threads)
        engine.shutdown()


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param({"backend": "fsdp2"}, id="fsdp2"),
        pytest.param({"backend": "fsdp2", "engine_ranks": 2}, id="fsdp2-2-engine-ranks"),
        pytest.param(
            {"backend": "deepspeed", "zero_stage": 3}, id="zero3", marks=pytest.mark.deepspeed
        ),
    ],
)
def test_trainer_ranks_train_apart_and_the_engine_rank_serves_them(
    model_dir: str, backend: dict[str, Any]
) -> None:
    from lightrft.engines import SamplingParams

    cfg = workers.separate_config(model_dir, **backend)
    engines = backend.get("engine_ranks", 1)
    trainer0, trainer1, *served = run_distributed(
        workers.sync_and_generate_case, 2 + engines, cfg, model_dir,
        init_process_group=False, timeout=240,
    )  # fmt: skip
    # the engine ranks served until the trainers closed, then exited with 0
    assert served == [{"engine_rank_exit": 0}] * engines
    # training sees 2 ranks: 4 samples = 2 per micro-batch x 2 trainer ranks, 1 step
    assert trainer0["world_size"] == trainer1["world_size"] == 2
    assert trainer0["accumulated_gradient"] == 1
    # each trainer rank got exactly its prompts' outputs (n=2 each), as the engine
    # ranks generating every trainer's prompts (each its share, in one call) give them
    sampling = SamplingParams(max_new_tokens=4, n=2, seed=3, temperature=1.0, logprobs=True)
    everything = workers.PROMPTS[0] + workers.PROMPTS[1]
    per = -(-len(everything) // engines)  # each engine rank its share, in one call
    want = [
        out
        for start in range(0, len(everything), per)
        for out in _reference_outputs(model_dir, everything[start : start + per], sampling)
    ]
    got = trainer0["before"] + trainer1["before"]
    assert len(trainer0["before"]) == 4 and len(trainer1["before"]) == 2
    assert [g[0] for g in got] == [w.output_token_ids for w in want]
    for (_, logprobs, version), w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(w.logprobs))
        assert version == 1  # the sync of setup_inference_engine(actor=...)
    assert trainer0["verified_before"] < 1e-3
    # the trained weights reached the engine: one more sync, verified against a forward
    assert trainer0["sync"]["weight_version"] == 2 and trainer0["sync"]["max_logprob_gap"] < 1e-3
    assert trainer0["sync"]["tensors"] == trainer0["params"]  # every parameter, once
    assert {o[1] for o in trainer0["after"] + trainer1["after"]} == {2}
    assert trainer0["losses"] != trainer1["losses"]  # each rank its own data
    # a rank with no prompts still takes part; a bad prompt on one rank is raised on
    # both, naming that rank, and no engine rank generated it
    assert trainer1["empty"] == 0 and trainer0["empty"] == 4
    for label, fragment in (("vocab", "5000"), ("empty", "empty")):
        assert trainer0["errors"][label] == trainer1["errors"][label]
        assert "PromptError" in trainer0["errors"][label], trainer0["errors"][label]
        assert "prompt 0 of rank 1" in trainer0["errors"][label]
        assert fragment in trainer0["errors"][label]


def test_a_killed_engine_rank_is_named_on_every_trainer_rank(
    model_dir: str, tmp_path: Path
) -> None:
    cfg = workers.separate_config(model_dir, dist_timeout_s=60)
    with pytest.raises(RankFailure) as info:
        run_distributed(
            workers.lost_engine_case, 3, cfg, model_dir, str(tmp_path),
            init_process_group=False, timeout=240,
        )  # fmt: skip
    assert set(info.value.failures) == {2}, info.value  # only the killed rank failed
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("EngineRankError"), message
        assert "engine rank(s) [2] exited" in message, message


def test_max_staleness_0_trains_as_colocated_and_1_runs_one_step_off(
    model_dir: str, tmp_path: Path
) -> None:
    """One trainer rank: colocated (1 rank), separate with max_staleness 0 and 1 (a
    trainer and an engine rank), the same loop of submit/collect; at 1 a checkpoint
    holds the rollouts in flight."""
    steps = 3
    single = workers.separate_config(model_dir, train_batch_size=2, micro_train_batch_size=2)
    colocated = {k: v for k, v in single.items() if k != "engine_placement"}
    (together,) = run_distributed(
        workers.staleness_case, 1, colocated, model_dir, steps,
        init_process_group=False, timeout=240,
    )  # fmt: skip
    fresh, engine = run_distributed(
        workers.staleness_case, 2, {**single, "max_staleness": 0}, model_dir, steps,
        init_process_group=False, timeout=240,
    )  # fmt: skip
    assert engine == {"engine_rank_exit": 0}
    # max_staleness 0: the rollouts, losses and parameters of the colocated layout
    assert fresh["tokens"] == together["tokens"]
    assert fresh["loss"] == together["loss"]
    assert fresh["lag"] == together["lag"] == [0] * steps
    for name, value in together["state"].items():
        torch.testing.assert_close(fresh["state"][name], value, rtol=0, atol=0, msg=name)
    # versions: the setup's sync is 1, then one sync per step after the first
    assert [set(v) for v in fresh["versions"]] == [{1}, {2}, {3}]
    ahead, _ = run_distributed(
        workers.staleness_case, 2, {**single, "max_staleness": 1}, model_dir, steps,
        str(tmp_path / "ckpt"), init_process_group=False, timeout=240,
    )  # fmt: skip
    # max_staleness 1: step s+1's rollouts were generated during step s's training,
    # from the weights before it: one version behind, and so lag 1
    assert ahead["tokens"][0] == fresh["tokens"][0]
    assert [set(v) for v in ahead["versions"]] == [{1}, {1}, {2}]
    assert ahead["lag"] == [0, 1, 1]
    assert ahead["logprobs"][0] == fresh["logprobs"][0]
    assert ahead["logprobs"][1] != fresh["logprobs"][1]  # the weights before step 1's update
    # the checkpoint after step 2 held step 3's rollouts, in flight: loaded (other prompts
    # in flight were dropped), step 3 gets those rollouts, one version behind, and the
    # same loss
    assert ahead["resumed"] == {"tokens": ahead["tokens"][2], "lag": 1,
                                "loss": ahead["loss"][2], "next": 4}  # fmt: skip


def test_the_roles_of_a_job() -> None:
    import dataclasses

    from lightrft.config import ConfigError, StrategyConfig
    from lightrft.strategy.distributed import LaunchEnv
    from lightrft.strategy.engine_ranks import Role

    job = [LaunchEnv(r, r, 4, 4, "127.0.0.1", 0, "torchrun") for r in range(4)]
    config = StrategyConfig(engine_placement="separate", engine_ranks=2)
    roles = [Role.of(config, launch) for launch in job]
    # (serves, rank and size in its process group, its group, channel rank): each engine
    # rank is an engine of its own
    assert [(r.serves, r.rank, r.size, r.name, r.channel_rank) for r in roles if r] == [
        (False, 0, 2, "trainers", 0), (False, 1, 2, "trainers", None),
        (True, 0, 1, "engine0", 1), (True, 0, 1, "engine1", 2),
    ]  # fmt: skip
    assert roles[0] is not None and roles[0].engine_job_ranks == [2, 3]
    assert Role.of(StrategyConfig(), job[0]) is None  # colocated
    # engine_tp_size 2 over 4 engine ranks: two tensor-parallel engines, each of them
    # its ranks' process group (its workers' world)
    wide = StrategyConfig(engine_placement="separate", engine_ranks=4, engine_tp_size=2)
    six = [dataclasses.replace(launch, rank=r, world_size=6) for r, launch in
           enumerate(job + job[:2])]  # fmt: skip
    engines = [Role.of(wide, launch) for launch in six][2:]
    assert [(r.rank, r.size, r.name, r.channel_rank) for r in engines if r] == [
        (0, 2, "engine0", 1), (1, 2, "engine0", 2), (0, 2, "engine1", 3), (1, 2, "engine1", 4)
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"engine_tp_size=2 does not divide engine_ranks=3"):
        StrategyConfig(engine_placement="separate", engine_ranks=3, engine_tp_size=2)


def test_a_lora_adapter_alone_reaches_the_engine_rank(tmp_path: Path) -> None:
    """lora_sync adapter with the engine on a rank of its own: each sync sends the
    adapter's tensors alone to the engine rank, which then generates what the merged
    trained model generates greedily; an engine there that serves no adapters (HF) is
    named on the trainers, with the fix."""
    from transformers import AutoModelForCausalLM

    from lightrft.strategy.lora import apply_lora
    from lightrft.testing.models import greedy_reference, save_tiny_qwen2

    from .lora_workers import LORA, PROBE
    from .lora_workers import config as lora_config

    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    cfg = lora_config(engine_type="fake", engine_placement="separate")
    *trainers, engine = run_distributed(
        workers.adapter_sync_case, 3, cfg, model_dir, init_process_group=False, timeout=240
    )
    assert engine == {"engine_rank_exit": 0}
    trained = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), **LORA)
    trained.load_state_dict(trainers[0]["full"])
    adapter = {n: p for n, p in trained.named_parameters() if ".lora_" in n}
    merged = trained.merge_and_unload().eval()
    assert [r["generated"][0] for r in trainers] == greedy_reference(merged, PROBE, 6)
    for r in trainers:
        for stats in r["stats"]:
            assert stats["lora"] == "adapter" and stats["tensors"] == len(adapter)
            assert stats["bytes"] == 4 * sum(p.numel() for p in adapter.values())
            assert stats["max_logprob_gap"] < 1e-3
        refused = r["errors"]["no_adapters"]
        assert "HFEngine on the engine ranks cannot serve LoRA adapters" in refused
        assert "set lora_sync='merged'" in refused
