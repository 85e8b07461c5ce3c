"""The durable tier written by the node agent (``--ft-persist-agent``): what the runtime's ``Durable``
component calls instead of an in-process :class:`moe_ft.persist.PersistWriter`.

The trainer sends a due iteration to the agent once its point is published (or a newer one is: a skipped
snapshot is never published), so the agent never waits on a point; the agent copies the newest recovery
point at or before it, verified, into the durable tier, exactly as the in-process writer does (the same
code, on a reader of this rank's store). Nothing of a point's bytes passes through the trainer.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Mapping

from moe_ft.agent.client import AgentClient, AgentCpu
from moe_ft.agent.server import PersistRequest
from moe_ft.persist.durable import DurableTier
from moe_ft.persist.writer import PersistRecord
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore
from moe_ft.store.rules import RecoveryRule, portable


class AgentPersistence:
    """Rank ``rank``'s durable copies, done by the node agent of ``agent_dir``."""

    def __init__(self, store: SnapshotStore, tier: DurableTier, rule: RecoveryRule, *, interval: int, keep: int = 2,
                 rank: int, job_id: str, agent_dir: str, idle_exit_s: float = 600.0) -> None:
        self.interval, self.keep = interval, keep
        self.store, self.tier, self.rule, self.rank, self.job_id = store, tier, rule, rank, job_id
        self.client = AgentClient(agent_dir, rank, idle_exit_s=idle_exit_s)
        self.client.call("ping")  # start (or find) the agent now, not at the first due snapshot
        self.records: list[PersistRecord] = []
        self.paused = ""
        """Non-empty while the agent's copies of this rank are paused (the durable directory is full)."""
        self.agent_cpu = AgentCpu()
        self._iteration = -1
        self._due: deque[tuple[int, Mapping[OperatorId, Level] | None]] = deque()
        self._lock = threading.Lock()  # the training thread and the engine's publishing thread both send
        store.on_publish.append(self._published)

    def due(self, iteration: int) -> bool:
        return bool(self.interval) and (iteration + 1) % self.interval == 0

    def submit(self, iteration: int, persist_plan: Mapping[OperatorId, Level] | None = None) -> None:
        """Called right after the snapshot of ``iteration`` is submitted (before it is published): a due
        iteration is sent when its point is published (:meth:`_published`) or, at the latest, here at the
        next snapshot."""
        with self._lock:
            self._iteration = iteration
            if self.due(iteration):
                self._due.append((iteration, persist_plan))
        self._send_published()

    def _published(self, iteration: int) -> None:
        """The store published ``iteration`` (engine thread): send what is due now, not one step later."""
        self._send_published()

    def _send_published(self) -> None:
        with self._lock:
            points = self.store.points()
            newest = max(points, default=-1)
            while self._due and self._due[0][0] <= newest:  # published, or a newer point is: never will be
                iteration, plan = self._due.popleft()
                self._take(self.client.persist(PersistRequest(
                    rank=self.rank, iteration=iteration, store_dir=self.store.backend.describe(),
                    persist_dir=str(self.tier.root), job_id=self.job_id, world_size=self.tier.world_size,
                    rule=portable(self.rule, points), plan=None if plan is None else dict(plan),
                    keep=self.keep)))

    def _take(self, state: dict) -> None:
        self.records = state["records"]
        self.paused = state.get("paused", "")  # an agent started by an older moe-ft does not say
        self.agent_cpu.take(self._iteration, state["cpu_s"])

    def agent_cpu_ms_per_iteration(self) -> float | None:
        """The agent process's CPU per training iteration between the last two requests (``None`` before)."""
        return self.agent_cpu.ms_per_iteration()

    def settle(self) -> None:
        """Wait until the agent finished this rank's copies (before the runtime discards an abandoned
        timeline from the tier: no copy of it lands afterwards)."""
        with self._lock:
            self._due.clear()  # iterations of the abandoned timeline
            self._take(self.client.flush())

    def flush(self) -> None:
        self._send_published()
        with self._lock:
            self._take(self.client.flush())

    def close(self) -> None:
        """End of training (the snapshots are all published by now): the last copies, then bye."""
        try:
            self.flush()
        finally:
            with self._lock:
                if self._published in self.store.on_publish:  # closed twice (an abandoned attempt, then its end)
                    self.store.on_publish.remove(self._published)
                self.client.bye()
