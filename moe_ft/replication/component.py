"""The replication's runtime component (MoEtion Alg. 2, §5.1): after each snapshot it enqueues the point for
the replica peers (the copies run on the service's own threads), labels the step's gradients for optimizer
recomputation (§5.2), and drops the replicas of an abandoned timeline after a recovery. It also carries the
fetch of lost points from the replicas held so far (``ReplicaFetch``), which a recovery needs even when the
ranks now all run on one node and replicate no more (spares took a lost node's ranks)."""

from __future__ import annotations

from moe_ft.runtime.components import Component


class Replicas(Component):
    """Peer replicas (MoEtion Alg. 2) of the session's store: enqueue after each snapshot."""

    def __init__(self, replication, fetch=None) -> None:
        self.replication = replication
        """The replication service (``service.Replication``), or ``None``: no other node to replicate to."""
        self.fetch = fetch
        """``service.ReplicaFetch``: the points lost with a node, from the replicas held so far."""
        self._engine = None

    def on_step_begin(self, iteration: int) -> None:
        if self.replication is not None:
            self.replication.begin_iteration(iteration)  # optimizer recomputation labels the step's gradients

    def remote_full(self, iteration: int, plan) -> frozenset:
        if self.replication is None:
            return frozenset()
        return self.replication.remote_full(iteration, plan)  # --ft-optimizer-recompute-local compute

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        self._engine = session.engine if session is not None else None
        if self.replication is not None:
            self.replication.track(plan)  # optimizer recomputation: whose gradients the next step captures
            self.replication.submit(iteration)  # enqueue only: the copies run on their own threads

    def after_recovery(self, report, session) -> None:
        # replicas of the abandoned timeline must not outlive it (lossy runs differ)
        if self.replication is not None:
            self.replication.discard_after(report.timeline_kept_through)

    def metrics(self, record) -> dict:
        if self.replication is None or record is None:
            return {}
        return self.replication.metrics(record.iteration)

    def close(self) -> None:
        if self.replication is not None:
            self.replication.close(self._engine.records if self._engine is not None else ())

    def abandon(self) -> None:
        """Closing would wait for every source to end its stream, and a source that died never does: the
        streams' threads are left to the failed attempt's groups (they end when a peer's connection
        closes, or block on a group nothing uses any more). The node agent, if it sends them, drops the
        attempt's sender."""
        if self.replication is not None:
            self.replication.abandon()
