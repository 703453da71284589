"""The launch environment (torchrun, SLURM, one process) and the checks made at setup."""

from __future__ import annotations

import pytest
import torch

from lightrft.config import ConfigError
from lightrft.strategy import get_strategy
from lightrft.strategy.distributed import LaunchEnv

from . import workers


def test_launch_env_from_torchrun() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"}  # fmt: skip
    launch = LaunchEnv.from_environ(env)
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (
        3,
        1,
        4,
        2,
    )
    assert (launch.master_addr, launch.master_port, launch.launcher) == (
        "10.0.0.1",
        29999,
        "torchrun",
    )


def test_launch_env_from_slurm() -> None:
    env = {
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "node1",
        "MASTER_PORT": "12345",
    }  # fmt: skip
    launch = LaunchEnv.from_environ(env)
    layout = (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size)
    assert layout == (5, 1, 8, 4)
    assert launch.launcher == "slurm"
    # the batch script itself (no srun step) is a single process
    del env["SLURM_STEP_NUM_TASKS"]
    assert LaunchEnv.from_environ(env).launcher == "single"


def test_launch_env_single_process() -> None:
    launch = LaunchEnv.from_environ({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4: must lie in \[0, WORLD_SIZE=4\)"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, r"RANK='x': environment variable must be an integer"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "export MASTER_PORT"),
    ],
)
def test_launch_env_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LaunchEnv.from_environ(env)


def test_world_size_check_runs_at_setup() -> None:
    with pytest.raises(ConfigError, match="sp_size=2: does not divide the world size 1"):
        get_strategy(workers.config(sp_size=2))  # setup runs in the constructor
    assert not torch.distributed.is_initialized()  # checked before any rendezvous
    deferred = get_strategy(workers.config(sp_size=2), defer_setup=True)
    with pytest.raises(ConfigError, match="sp_size=2: does not divide the world size 1"):
        deferred.setup_distributed()
    assert not torch.distributed.is_initialized()


def test_cuda_requested_without_cuda_is_an_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device='cuda': CUDA is not available here"):
        get_strategy(workers.config(device="cuda"))
