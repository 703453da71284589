"""The Ulysses hook beyond Qwen2 (Llama, Qwen3, the language models of Qwen2-VL and
Qwen2.5-VL) against the same model unhooked, upstream's preprocess/postprocess shape,
and the errors raised before any work; on 2 real gloo ranks."""

from __future__ import annotations

import pytest

from lightrft.testing.launcher import run_distributed

from .sp_workers import families_case, upstream_shapes_case

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_llama_qwen3_and_qwen_vl_split_over_two_ranks_match_the_whole_model() -> None:
    for rank in run_distributed(families_case, 2):
        for family in ("llama", "qwen3", "qwen2_vl", "qwen2_5_vl"):
            got = rank[family]
            assert got["log_prob_diff"] < 2e-5, family
            assert got["grad_diff"] < 1e-6, family


def test_a_replicas_rows_are_computed_once_per_group_and_errors() -> None:
    r0, r1 = run_distributed(upstream_shapes_case, 2, init_process_group=False)
    assert r0["loader"] == r1["loader"] and len(r0["loader"]) == 4  # one replica: same items
    for rank, got in enumerate((r0, r1)):
        assert got["processor_keeps"]  # the strategy's processor: nothing to gather
        # the replica's 2 rows computed once (half the tokens each), then 2 rows that
        # differ per rank computed together (1 row each, 2 pooled)
        assert got["layer_tokens"] == [[2, 6], [2, 6]]
        assert got["lp_diff"] < 2e-5 and got["own_lp_diff"] < 2e-5, rank
        errors = got["errors"]
        assert "num_key_value_heads=1" in errors["kv_heads"]
        assert "accepted sp_size values for this model: 1" in errors["kv_heads"]
        assert "Qwen2ForCausalLM" in errors["kv_heads"]
        assert "TinyRegressor" in errors["family"] and "set sp_size=1" in errors["family"]
        assert "qwen2, qwen3, llama" in errors["family"]
        assert "generate with the inference engine" in errors["cache"]
