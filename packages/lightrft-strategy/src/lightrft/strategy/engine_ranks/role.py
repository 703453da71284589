"""This process's part in a job whose rollout engines have ranks of their own
(``engine_placement: separate``): the first ranks train, the last ``engine_ranks`` serve."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightrft.config import ConfigError, ConfigProblem
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
        engines: the job's last ranks, which serve engines (a group of their own).
    """

    job: LaunchEnv
    trainers: int
    engines: int

    @classmethod
    def of(cls, config: StrategyConfig, job: LaunchEnv) -> Role | None:
        """The role of this process, or None when engines are colocated."""
        if config.engine_placement != "separate":
            return None
        if config.engine_tp_size > 1:
            raise ConfigError(
                [
                    ConfigProblem(
                        "engine_tp_size",
                        config.engine_tp_size,
                        "with engine_placement='separate' each engine rank serves a whole "
                        "engine (tensor parallelism across engine ranks is not built yet)",
                        fix="set engine_tp_size=1 (engine_ranks engines serve side by side), "
                        "or use engine_placement=colocated",
                    )
                ]
            )
        trainers = config.trainer_ranks(job.world_size)
        return cls(job, trainers, job.world_size - trainers)

    @property
    def serves(self) -> bool:
        """Whether this rank serves an engine (else it trains)."""
        return self.job.rank >= self.trainers

    @property
    def name(self) -> str:
        return "engines" if self.serves else "trainers"

    @property
    def rank(self) -> int:
        """This rank within its role's group."""
        return self.job.rank - self.trainers if self.serves else self.job.rank

    @property
    def size(self) -> int:
        """The ranks of this rank's role."""
        return self.engines if self.serves else self.trainers

    @property
    def engine_job_ranks(self) -> list[int]:
        """The job ranks that serve engines."""
        return list(range(self.trainers, self.job.world_size))

    @property
    def channel_rank(self) -> int | None:
        """This rank in the channel between trainer rank 0 (0) and the engine ranks
        (1, 2, ...); None for the other trainer ranks, which are not in it."""
        if self.serves:
            return 1 + self.rank
        return 0 if self.job.rank == 0 else None

    def launch(self) -> LaunchEnv:
        """The launch as the role's group sees it: its rank and size in the role."""
        return dataclasses.replace(self.job, rank=self.rank, world_size=self.size)
