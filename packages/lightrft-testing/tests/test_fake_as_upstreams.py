"""FakeStrategy as a drop-in for upstream LightRFT's fake in a trainer's unit tests.

Upstream's ``lightrft/strategy/test_fake_strategy.py`` (49e62cb) passes here except
where the fake deliberately behaves as the real strategies (``all_gather``
concatenates, optimizer steps follow gradient accumulation, a checkpoint is a
directory). These tests make its calls, in its shapes, and assert what a user of
upstream's fake relies on; the GRPO replay then runs upstream's whole flow on it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightrft.strategy import FakeStrategy as FromStrategyPackage
from lightrft.strategy.fake_strategy import FakeStrategy as FromUpstreamPath
from lightrft.testing import FakeEngine, FakeStrategy, get_fake_strategy
from lightrft.testing.models import save_tiny_qwen2
from lightrft.testing.upstream_replay import export_gap, replay_grpo


def _upstream_fake() -> FakeStrategy:
    return FakeStrategy(seed=42, max_norm=1.0, micro_train_batch_size=2, train_batch_size=8)


def test_upstreams_import_paths_give_this_fake() -> None:
    assert FromStrategyPackage is FakeStrategy is FromUpstreamPath


def test_prepare_returns_the_modules_it_was_given_and_still_computes_in_bf16() -> None:
    strategy = _upstream_fake()  # bf16 by default
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    assert strategy.prepare(model) is model
    assert strategy.prepare((model, optimizer, None)) == (model, optimizer, None)
    both = strategy.prepare(model, (model, optimizer, None))
    assert both[0] is model and both[1] == (model, optimizer, None)
    x = torch.randn(2, 4)
    out = model(x)
    assert out.dtype == torch.bfloat16  # the forward ran in bf16 ...
    assert model.weight.dtype == torch.float32  # ... on fp32 masters
    assert set(model.state_dict()) == {"weight", "bias"}  # names unchanged
    out.float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32
    expected = nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
    assert torch.equal(out, expected)


def test_a_forward_that_raises_leaves_the_fp32_parameters_in_place() -> None:
    strategy = _upstream_fake()
    model = strategy.prepare(nn.Linear(4, 3))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert isinstance(model.weight, nn.Parameter) and model.weight.dtype == torch.float32


def test_production_sizes_are_simulated_in_one_process(caplog: pytest.LogCaptureFixture) -> None:
    args = SimpleNamespace(seed=999, micro_train_batch_size=8, train_batch_size=32, sp_size=2,
                           engine_tp_size=4, bf16=True, engine_type="vllm")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightrft.testing"):
        strategy = FakeStrategy(args=args)
    assert "sp_size=2, engine_tp_size=4 simulated in one process" in caplog.text
    assert strategy.config.sp_size == 2 and strategy.config.engine_tp_size == 4  # as given
    assert strategy.accumulated_gradient == 4  # one data-parallel rank: 32 / 8
    assert strategy.sp_data_processor is not None
    assert strategy.sp_data_processor.preprocess([1, 2]) == [1, 2]  # its group is itself
    engine = strategy.setup_inference_engine(FakeEngine())
    assert strategy.engine_mp_group is None
    outputs = strategy.gather_and_generate(sampling_params={"max_new_tokens": 2},
                                           all_prompt_token_ids=[[1, 2], [3]])  # fmt: skip
    assert [o.prompt_token_ids for o in outputs] == [[1, 2], [3]]
    assert engine.generate_calls == 1


def test_an_engine_of_its_own_is_simulated_in_one_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trainer's real config with engine_placement separate (engine_ranks,
    max_staleness) runs on the fake: the engine is this process's, a submitted step is
    generated at collect from the newest weights, and its lag is 0."""
    from lightrft.strategy import get_strategy

    config = {"backend": "fake", "engine_placement": "separate", "engine_ranks": 2,
              "max_staleness": 1, "train_batch_size": 4, "micro_train_batch_size": 2}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightrft.testing"):
        strategy = get_strategy(config)
    assert "engine_placement=separate simulated in one process" in caplog.text
    assert strategy.config.engine_placement == "separate"  # as given
    engine = strategy.setup_inference_engine(FakeEngine())
    strategy.submit_generation([[1, 2], [3]], {"max_new_tokens": 2})
    assert engine.generate_calls == 0  # generated at collect, from the newest weights
    outputs = strategy.collect_generation()
    assert [o.prompt_token_ids for o in outputs] == [[1, 2], [3]]
    assert engine.generate_calls == 1 and strategy.rollout_lag(outputs) == 0
    strategy.close()


def test_engine_calls_carry_on_without_an_engine_as_upstreams_fake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = _upstream_fake()
    model = nn.Linear(4, 3)
    with caplog.at_level(logging.WARNING, logger="lightrft.strategy.engine_link"):
        assert strategy.update_engine_weights(model) == {}  # no engine: nothing sent
    assert "no inference engine is set up" in caplog.text
    engine = strategy.setup_inference_engine(None)  # nothing configured: a FakeEngine
    assert isinstance(engine, FakeEngine) and strategy.inference_engine is engine
    strategy.maybe_sleep_inference_engine()
    strategy.wakeup_inference_engine()
    assert strategy.engine_generate_local(None) == []
    assert strategy.gather_and_generate(None) == []


def test_optimizer_offload_calls_return_the_optimizer() -> None:
    strategy = _upstream_fake()
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert strategy.maybe_offload_optimizer(optimizer) is optimizer
    assert strategy.maybe_load_optimizer(optimizer) is optimizer


def test_get_fake_strategy_reads_an_args_object() -> None:
    args = SimpleNamespace(seed=123, max_norm=2.0, micro_train_batch_size=4, train_batch_size=16)
    strategy = get_fake_strategy(args)
    assert (strategy.seed, strategy.max_norm, strategy.micro_train_batch_size) == (123, 2.0, 4)
    assert strategy.train_batch_size == 16


def test_upstreams_grpo_flow_runs_on_the_fake(tmp_path: Path) -> None:
    model_dir = str(save_tiny_qwen2(tmp_path / "qwen2"))
    # one rank: train_batch_size 2 keeps one micro-batch per step, as 4 does on 2 ranks
    facts = replay_grpo(
        {"backend": "fake", "train_batch_size": 2}, model_dir, str(tmp_path / "run")
    )
    assert facts["actor_is_wrapper"]
    assert [p for p, _ in facts["rollout"]] == facts["prompts"]
    assert facts["rollout_vllm_form"] == [out for _, out in facts["rollout"]]
    assert facts["stepped"] and facts["ema_updated"] and facts["synced_tensors"] > 0
    assert facts["verify"]["max_logprob_gap"] <= 1e-3
    assert facts["loaded"] == facts["saved"] != facts["after_step2"]
    assert facts["after_step2_resumed"] == facts["after_step2"]
    gap, encoded = export_gap(facts)
    assert gap < 1e-5 and encoded == [3, 5]
