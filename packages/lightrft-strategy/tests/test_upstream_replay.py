"""Upstream LightRFT's trainers, replayed call by call on 2 real gloo ranks.

:mod:`lightrft.testing.upstream_replay` makes the calls upstream's GRPO flow
(``train_colocate.py``, ``SPMDPPOTrainerVL``, ``FastExperienceMaker``) and its
reward-model flow make, in their argument shapes, with upstream's actor wrapper
(``actor.model`` is the Hugging Face model). Here each replay runs on FSDP2 and on
DeepSpeed ZeRO-2 and ZeRO-3 and its facts are checked: the rollout returns each rank
its prompts with the engine's greedy continuation, the sync sends Hugging Face names
and the engine then computes the trainer's log-probabilities, the checkpoint of
``actor.model`` resumes exactly with its optimizer and scheduler, and the export loads
in transformers with the trainer's logits.
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


def _replay(flow: Any, backend: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    """``flow`` on 2 ranks of ``backend``, on a tiny Qwen2 saved as a model directory."""
    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    return run_distributed(flow, 2, backend, model_dir, str(tmp_path / "run"),
                           init_process_group=False, timeout=500)  # fmt: skip


@pytest.mark.parametrize("backend", list(BACKENDS.values()))
def test_upstream_grpo_flow_on_two_ranks(backend: dict[str, Any], tmp_path: Path) -> None:
    check_grpo_facts(_replay(replay_grpo, backend, tmp_path))


@pytest.mark.parametrize("backend", list(BACKENDS.values()))
def test_upstream_reward_model_flow_on_two_ranks(backend: dict[str, Any], tmp_path: Path) -> None:
    ranks = _replay(replay_reward_model, backend, tmp_path)
    for facts in ranks:
        assert len(facts["losses"]) == 2  # 8 items / (2 per batch x 2 ranks)
        assert facts["consumed_samples"] == 8 and facts["same_after_load"]
    assert ranks[0]["exported"]
