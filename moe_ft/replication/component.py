"""The replication's runtime component (MoEtion Alg. 2, §5.1): after each snapshot it enqueues the point for
the replica peers (the copies run on the service's own threads), labels the step's gradients for optimizer
recomputation (§5.2), and drops the replicas of an abandoned timeline after a recovery."""

from __future__ import annotations

from moe_ft.runtime.components import Component


class Replicas(Component):
    """Peer replicas (MoEtion Alg. 2) of the session's store: enqueue after each snapshot."""

    def __init__(self, replication) -> None:
        self.replication = replication
        self._engine = None

    def on_step_begin(self, iteration: int) -> None:
        self.replication.begin_iteration(iteration)  # optimizer recomputation labels the step's gradients

    def remote_full(self, iteration: int, plan) -> frozenset:
        return self.replication.remote_full(iteration, plan)  # --ft-optimizer-recompute-local compute

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        self._engine = session.engine if session is not None else None
        self.replication.track(plan)  # optimizer recomputation: whose gradients the next step captures
        self.replication.submit(iteration)  # enqueue only: the copies run on their own threads

    def after_recovery(self, report, session) -> None:
        # replicas of the abandoned timeline must not outlive it (lossy runs differ)
        self.replication.discard_after(report.timeline_kept_through)

    def metrics(self, record) -> dict:
        return self.replication.metrics(record.iteration) if record is not None else {}

    def close(self) -> None:
        self.replication.close(self._engine.records if self._engine is not None else ())

    def abandon(self) -> None:
        """Closing would wait for every source to end its stream, and a source that died never does: the
        streams' threads are left to the failed attempt's groups (they end when a peer's connection
        closes, or block on a group nothing uses any more)."""
