"""Upstream LightRFT's trainers, replayed call by call on 2 real gloo ranks.

:mod:`lightrft.testing.upstream_replay` makes the calls upstream's GRPO flow
(``train_colocate.py``, ``SPMDPPOTrainerVL``, ``FastExperienceMaker``) and its
reward-model flow make, in their argument shapes, with upstream's actor wrapper
(``actor.model`` is the Hugging Face model). Here each replay runs on FSDP2 and on
DeepSpeed ZeRO-2 and ZeRO-3 and its facts are checked: the rollout returns each rank
its prompts with the engine's greedy continuation, the sync sends Hugging Face names
and the engine then computes the trainer's log-probabilities, the checkpoint of
``actor.model`` resumes exactly with its optimizer and scheduler, and the export loads
in transformers with the trainer's logits. The GRPO flow runs unchanged with the
engine on a rank of its own too (``engine_placement: separate``, 2 trainer ranks and 1
engine rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightrft.testing.launcher import run_distributed
from lightrft.testing.models import save_tiny_qwen2
from lightrft.testing.upstream_replay import export_gap, replay_grpo, replay_reward_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

BACKENDS = {
    "fsdp2": pytest.param({"backend": "fsdp2", "fsdp": True}, id="fsdp2"),
    "zero2": pytest.param(
        {"backend": "deepspeed", "zero_stage": 2}, id="zero2", marks=pytest.mark.deepspeed
    ),
    "zero3": pytest.param(
        {"backend": "deepspeed", "zero_stage": 3}, id="zero3", marks=pytest.mark.deepspeed
    ),
}


def check_grpo_facts(ranks: list[dict[str, Any]]) -> None:
    """What upstream's flow needs of a strategy, as the facts of a replay show it."""
    for facts in ranks:
        assert facts["actor_is_wrapper"], "prepare_models_and_optimizers must return the actor"
        assert facts["critic"] == (None, None, None)
        assert facts["config_of_unwrapped"] == "Qwen2Config"
        # each rank gets exactly its prompts back, with 4 greedy tokens; both sampling
        # forms (SGLang's dict, vLLM's attributes) mean the same greedy decoding
        assert [p for p, _ in facts["rollout"]] == facts["prompts"]
        assert all(len(out) == 4 for _, out in facts["rollout"])
        assert facts["rollout_vllm_form"] == [out for _, out in facts["rollout"]]
        assert facts["sp_roundtrip"] == facts["rollout_vllm_form"]  # sp_size 1: identity
        assert facts["stepped"] and facts["loss"] == facts["loss"]  # stepped, not NaN
        assert facts["ema_updated"]
        assert facts["synced_tensors"] > 0
        assert facts["verify"]["max_logprob_gap"] <= 1e-3  # the engine computes the trainer's
        # save_ckpt(actor.model) -> step -> load_ckpt(actor.model, optimizer=, scheduler=)
        assert facts["loaded"] == facts["saved"] != facts["after_step2"]
        assert facts["after_step2_resumed"] == facts["after_step2"]  # optimizer state resumed
        assert facts["consumed_samples"] == 4
    # one model: the same weights on every rank after each step
    assert len({f["saved"] for f in ranks}) == 1
    assert len({f["after_step2"] for f in ranks}) == 1
    gap, encoded = export_gap(ranks[0])  # save_model(actor, tokenizer, dir) loads back
    assert gap < 1e-5 and encoded == [3, 5]


def _replay(
    flow: Any, backend: dict[str, Any], tmp_path: Path, ranks: int = 2
) -> list[dict[str, Any]]:
    """``flow`` on ``ranks`` ranks of ``backend``, on a tiny Qwen2 saved as a model
    directory."""
    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    return run_distributed(flow, ranks, backend, model_dir, str(tmp_path / "run"),
                           init_process_group=False, timeout=500)  # fmt: skip


def replay_grpo_or_serve(
    strategy_args: dict[str, Any], model_dir: str, workdir: str
) -> dict[str, Any]:
    """Upstream's GRPO flow on a trainer rank; on an engine rank (it never returns from
    ``get_strategy``), the code it exited with once the trainers closed."""
    try:
        return replay_grpo(strategy_args, model_dir, workdir)
    except SystemExit as exc:
        return {"engine_rank_exit": exc.code}


@pytest.mark.parametrize("backend", list(BACKENDS.values()))
def test_upstream_grpo_flow_on_two_ranks(backend: dict[str, Any], tmp_path: Path) -> None:
    check_grpo_facts(_replay(replay_grpo, backend, tmp_path))


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param({"backend": "fsdp2", "fsdp": True}, id="fsdp2"),
        pytest.param(
            {"backend": "deepspeed", "zero_stage": 3}, id="zero3", marks=pytest.mark.deepspeed
        ),
    ],
)
def test_upstream_grpo_flow_with_the_engine_on_a_rank_of_its_own(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    """train_colocate.py's calls, unchanged, on a 3-rank job with engine_placement
    separate: the 2 trainer ranks show every fact of the colocated replay (their
    rollouts come from the engine rank, the sync reaches it and verifies), and the
    engine rank exits 0 when the trainers close."""
    separate = {**backend, "engine_placement": "separate"}
    *trainers, engine = _replay(replay_grpo_or_serve, separate, tmp_path, ranks=3)
    assert engine == {"engine_rank_exit": 0}
    assert [facts["rank"] for facts in trainers] == [0, 1]
    check_grpo_facts(trainers)


@pytest.mark.parametrize("backend", list(BACKENDS.values()))
def test_upstream_reward_model_flow_on_two_ranks(backend: dict[str, Any], tmp_path: Path) -> None:
    ranks = _replay(replay_reward_model, backend, tmp_path)
    for facts in ranks:
        assert len(facts["losses"]) == 2  # 8 items / (2 per batch x 2 ranks)
        assert facts["consumed_samples"] == 8 and facts["same_after_load"]
    assert ranks[0]["exported"]
