"""Dense baseline (CheckFreq / Gemini style): every operator FULL every ``interval`` iterations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from moe_ft.policy.base import SnapshotPolicy, make_plan
from moe_ft.state.operators import Level, OperatorInfo, SnapshotPlan


@dataclass(kw_only=True)
class DenseConfig:
    interval: int = 1
    """Snapshot every ``interval`` iterations: after iterations ``t`` with ``t % interval == offset``."""
    offset: int = 0
    """Phase of the schedule, in ``[0, interval)``."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"DenseConfig.interval must be >= 1, got {self.interval}")
        if not 0 <= self.offset < self.interval:
            raise ValueError(f"DenseConfig.offset must be in [0, interval={self.interval}), got {self.offset}")


class DensePolicy(SnapshotPolicy):
    """FULL for all operators at checkpoint iterations, NONE otherwise. Stateless."""

    name = "dense"
    dense_points = True
    starts_dense = True

    @classmethod
    def config_from_flags(cls, flags, t_iter_s: float, *, replication=None) -> DenseConfig:
        return DenseConfig(interval=flags.dense_interval)

    def __init__(self, config: DenseConfig, operators: Sequence[OperatorInfo]) -> None:
        super().__init__(operators)
        self.config = config
        self.forced: set[int] = set()
        """Iterations snapshotted FULL outside the interval (:meth:`start_dense`); any FULL point is a
        recovery point (``DenseRule``), so nothing else needs to remember them."""

    def is_checkpoint(self, iteration: int) -> bool:
        return iteration % self.config.interval == self.config.offset or iteration in self.forced

    def retained_points(self) -> int:
        """Every iteration publishes a point (NONE between checkpoints): each retained checkpoint spans
        ``interval`` of them."""
        return super().retained_points() * self.config.interval

    def start_dense(self, iteration: int) -> None:
        self.forced = {it for it in self.forced if it >= iteration} | {iteration}

    def plan(self, iteration: int, popularity: Optional[object] = None) -> SnapshotPlan:
        level = Level.FULL if self.is_checkpoint(iteration) else Level.NONE
        return make_plan(self.operators, {i.op: level for i in self.operators})
