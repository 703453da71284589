"""lightrft-testing's conformance suite against this package's backends, 2 gloo ranks.

DeepSpeed runs it at ZeRO-0 (the strategy clips and skips itself) and ZeRO-3 (the
partitioned parameters). ZeRO-1 and ZeRO-2 share one DeepSpeed optimizer and one
checkpoint layout; their training parity, resume, conversion, export, sequence
parallelism, demo and upstream replays are tested in the other files, and they are not
run through the whole suite again, to keep CI's time."""

from __future__ import annotations

import pytest

from lightrft.testing.conformance import StrategyConformance


@pytest.mark.distributed
class TestFSDP2Conformance(StrategyConformance):
    backend = {"backend": "fsdp2"}  # noqa: RUF012 - the suite's class attribute
    world_size = 2


@pytest.mark.deepspeed
@pytest.mark.distributed
class TestZero0Conformance(StrategyConformance):
    """Stage 0 in fp32 is the one path where the strategy clips and skips itself; in
    bf16 its masters live in an unfused optimizer that full_state_dict reads."""

    backend = {"backend": "deepspeed", "zero_stage": 0}  # noqa: RUF012
    world_size = 2


@pytest.mark.deepspeed
@pytest.mark.distributed
class TestZero3Conformance(StrategyConformance):
    backend = {"backend": "deepspeed", "zero_stage": 3}  # noqa: RUF012
    world_size = 2
