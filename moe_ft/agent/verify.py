"""Checksums by the node agent (``--ft-checksum-by agent``): the trainer writes each snapshot byte once.

The store writes every operator entry with its digest deferred (``moe_ft.store.codec.PENDING``: zeros in the
trailer's digest, an empty checksum in the manifest) and publishes the point as usual. When it is published,
this component asks the node agent to hash it: the agent reads the point's pending entries (a reader of this
rank's store, pinning the point against garbage collection), checks their structure and keys, and records
their digests beside the point (``SnapshotStore.record_verified``: ``<store>/verified/<t>.json``, naming the
manifest it was computed under). From then on every reader verifies those entries as it verifies any other
(recovery, the durable tier, ``moe-ft inspect``). An entry the agent has not hashed yet (it was killed, or is
behind) is *unverified*: readers check its structure and key, not its bytes, and the store logs it once.

The durable copies of ``--ft-persist-agent`` run on the same per-rank queue in the agent, after the hashing
of the point they copy: they carry the recorded digests into the durable manifest.
"""

from __future__ import annotations

from moe_ft.agent.client import AgentClient, AgentCpu
from moe_ft.agent.server import VerifyRequest
from moe_ft.runtime.components import Component
from moe_ft.store import SnapshotStore


class AgentChecksums(Component):
    """Rank ``rank``'s published points, hashed by the node agent of ``agent_dir``."""

    def __init__(self, store: SnapshotStore, *, rank: int, agent_dir: str, idle_exit_s: float = 600.0) -> None:
        self.rank = rank
        self.client = AgentClient(agent_dir, rank, idle_exit_s=idle_exit_s)
        self.client.call("ping")  # start (or find) the agent now, not at the first publish
        self.verified = 0
        """Points of this rank the agent recorded digests for (as of its last answer)."""
        self.agent_cpu = AgentCpu()
        self.final: dict | None = None
        """The agent's last answer to this rank, once :meth:`close` waited for its hashing."""
        self.store = store
        store.on_publish.insert(0, self._published)  # first: the agent hashes a point before it copies it

    def _published(self, iteration: int) -> None:
        """The store published ``iteration`` (the engine's thread): queue its hashing in the agent."""
        state = self.client.call("verify", VerifyRequest(self.rank, iteration, self.store.backend.describe()))
        self.verified = state["verified"]
        self.agent_cpu.take(iteration, state["cpu_s"])

    def after_reconfigure(self, session) -> None:
        """A new snapshot session (a rebalance's dense restart): follow its store."""
        if self._published in self.store.on_publish:
            self.store.on_publish.remove(self._published)
        self.store = session.store
        self.store.on_publish.insert(0, self._published)

    def metrics(self, record) -> dict:
        out: dict[str, float] = {"agent_verified": self.verified}
        if (ms := self.agent_cpu.ms_per_iteration()) is not None:
            out["agent_cpu_ms"] = ms  # the node agent's CPU (hashing, and durable copies if it makes them)
        return out

    def close(self) -> None:
        """End of training: wait for the agent's hashing of this rank's points, then bye."""
        try:
            self.final = self.client.call("flush", self.rank)
            self.verified = self.final["verified"]
        finally:
            if self._published in self.store.on_publish:
                self.store.on_publish.remove(self._published)
            self.client.bye()
