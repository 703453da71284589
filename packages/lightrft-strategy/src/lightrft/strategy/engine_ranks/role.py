"""This process's part in a job whose rollout engines have ranks of their own
(``engine_placement: separate``): the first ranks train, the last ``engine_ranks`` serve."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightrft.strategy.distributed import LaunchEnv

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig


@dataclass(frozen=True)
class Role:
    """Where this rank sits among the trainers and the engine ranks of its job.

    Attributes:
        job: the launcher's view of the whole job.
        trainers: the job's first ranks, which train (their process group is the
            default one: every collective of training stays among them).
        engines: the job's last ranks, which serve engines (each engine's ranks a
            group of their own).
        tp: engine ranks per engine (``engine_tp_size``).
    """

    job: LaunchEnv
    trainers: int
    engines: int
    #: Engine ranks per engine (``engine_tp_size``): consecutive engine ranks make one
    #: tensor-parallel engine, whose ranks all generate every prompt it gets.
    tp: int = 1

    @classmethod
    def of(cls, config: StrategyConfig, job: LaunchEnv) -> Role | None:
        """The role of this process, or None when engines are colocated."""
        if config.engine_placement != "separate":
            return None
        trainers = config.trainer_ranks(job.world_size)  # (the config checked the sizes)
        return cls(job, trainers, job.world_size - trainers, config.engine_tp_size)

    @property
    def serves(self) -> bool:
        """Whether this rank serves an engine (else it trains)."""
        return self.job.rank >= self.trainers

    @property
    def engine_index(self) -> int:
        """This engine rank among the engine ranks (0, 1, ...)."""
        return self.job.rank - self.trainers

    @property
    def name(self) -> str:
        """The name of this rank's process group: the trainers, or its engine's ranks
        (each tensor-parallel engine has a group of its own: its workers' world)."""
        return f"engine{self.engine_index // self.tp}" if self.serves else "trainers"

    @property
    def rank(self) -> int:
        """This rank within its process group."""
        return self.engine_index % self.tp if self.serves else self.job.rank

    @property
    def size(self) -> int:
        """The ranks of this rank's process group."""
        return self.tp if self.serves else self.trainers

    @property
    def engine_job_ranks(self) -> list[int]:
        """The job ranks that serve engines."""
        return list(range(self.trainers, self.job.world_size))

    @property
    def channel_rank(self) -> int | None:
        """This rank in the channel between trainer rank 0 (0) and the engine ranks
        (1, 2, ...); None for the other trainer ranks, which are not in it."""
        if self.serves:
            return 1 + self.engine_index
        return 0 if self.job.rank == 0 else None

    def launch(self) -> LaunchEnv:
        """The launch as the role's group sees it: its rank and size in the role."""
        return dataclasses.replace(self.job, rank=self.rank, world_size=self.size)
