"""Faults on 2 real gloo ranks: a rank killed in each phase, a stalled rank, and
close-and-rebuild in one job. The survivor must stop within the collective timeout
with an error naming the lost rank, and the last complete checkpoint must still load
with exactly the weights it was saved with."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.testing.launcher import RankFailure, run_distributed
from tests import fault_workers, workers

TIMEOUT_S = 20.0  # the collective timeout of the killed-rank jobs


BACKENDS = [
    pytest.param({}, id="fsdp2"),
    pytest.param(
        {"backend": "deepspeed", "zero_stage": 3}, id="zero3", marks=pytest.mark.deepspeed
    ),
]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", fault_workers.PHASES)
def test_a_rank_killed_mid_phase_is_named_and_the_last_checkpoint_loads(
    tmp_path: Path, phase: str, backend: dict[str, Any]
) -> None:
    seed = int(time.time()) % 1000  # a different moment each run, printed on failure
    cfg = fault_workers.fault_config(TIMEOUT_S, **backend)
    with pytest.raises(RankFailure) as failed:
        run_distributed(
            fault_workers.killed_rank_case, 2, cfg, str(tmp_path), phase, seed,
            init_process_group=False, timeout=200, failure_grace=3 * TIMEOUT_S,
        )  # fmt: skip
    killed = json.loads((tmp_path / "killed.json").read_text())
    context = f"seed {seed}, rank 1 killed at {killed['where']}"
    assert set(failed.value.failures) == {0, 1}, context
    assert "SIGKILL" in failed.value.failures[1], context
    assert (tmp_path / "rank0.json").is_file(), (context, failed.value.failures[0][-2000:])
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    assert survivor["rank"] == 0
    assert list(survivor["missing"]) == ["1"], (context, survivor["message"])
    assert "rank 1 " in survivor["message"] and "has exited" in survivor["message"], context
    assert f"{survivor['operation']} #" in survivor["message"]
    assert survivor["detected_at"] - killed["at"] < TIMEOUT_S, context

    # the newest complete checkpoint loads, with the weights it was saved with
    loaded = run_distributed(
        workers.load_full_checkpoint, 2, fault_workers.fault_config(TIMEOUT_S, **backend),
        str(tmp_path / "ckpt"), init_process_group=False,
    )[0]  # fmt: skip
    expected = torch.load(tmp_path / "complete_weights.pt", weights_only=True)
    assert Path(loaded["path"]).name == "global_step1", context
    assert loaded["state"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded["state"][name], tensor), (context, name)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stalled_rank_fails_the_others_within_the_timeout_with_a_roll_call() -> None:
    timeout_s = 3.0
    cfg = fault_workers.fault_config(timeout_s)
    ranks = run_distributed(
        fault_workers.stuck_rank_case, 2, cfg, 4 * timeout_s,
        init_process_group=False, timeout=100,
    )  # fmt: skip
    waiting = ranks[0]
    assert waiting["operation"] == "optimizer_step", waiting
    assert timeout_s * 0.9 <= waiting["waited_s"] < 3 * timeout_s, waiting
    assert list(waiting["missing"]) == [1], waiting
    assert waiting["missing"][1].startswith("last reached backward #"), waiting
    message = waiting["message"]
    assert message.startswith("optimizer_step #"), message
    assert "failed on rank 0 of 2: rank 1 last reached backward #" in message
    assert "The collective timeout is 3 s" in message and "dist_timeout_s" in message


@pytest.mark.distributed
@pytest.mark.parametrize(("setup_timeout_s", "expected"), [(None, 42.0), (17.0, 17.0)])
def test_every_group_the_strategy_makes_has_its_timeout(
    setup_timeout_s: float | None, expected: float
) -> None:
    """torch gives a new_group 30 minutes whatever the process group's timeout; the
    strategy's sub-groups take dist_timeout_s (or setup_distributed's timeout)."""
    cfg = workers.config(dist_timeout_s=42.0, sp_size=2, engine_tp_size=2)
    ranks = run_distributed(
        fault_workers.group_timeouts_case, 2, cfg, setup_timeout_s, init_process_group=False
    )
    for found in ranks:
        assert found == {"world": expected, "sequence_parallel": expected, "engine_tp": expected}
