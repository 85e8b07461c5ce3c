"""The trainer's side of replication by the node agents (``--ft-replicate-by agent``; the agents' side and the
wire: ``moe_ft/agent/replicas.py``, ``wire.py``).

:func:`agent_endpoints` (collective, at build) has every rank's node agent listen for replicas and gathers
where each rank's replicas go; :class:`AgentSender` and :class:`AgentReceiver` then stand in for the
trainer's own sender and receiver in :class:`~moe_ft.replication.service.Replication`: the sender only names
each point to its agent, and the receiver asks its agent what arrived. No payload byte passes through the
trainer.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Mapping, Optional, Sequence

from moe_ft import comm
from moe_ft.agent.client import AgentClient, AgentCpu
from moe_ft.agent.replicas import Destination, ReplicaSelect, ReplicateRequest
from moe_ft.agent.wire import KEEP_POINTS
from moe_ft.background import BackgroundWorker
from moe_ft.replication.receiver import Rejection
from moe_ft.replication.sender import SentRecord
from moe_ft.state.operators import Level, OperatorId


def agent_endpoints(client: AgentClient, *, rank: int, store_root: str, job_id: str,
                    per_holder: bool) -> dict[int, Destination]:
    """Collective over every rank: ``{rank: Destination}``, where the replicas each rank holds go (its node
    agent's address, its store root). This rank's streams start afresh on its agent first."""
    host, port = client.call("replica_listen")
    client.call("replica_open", rank)
    mine = Destination(rank=rank, host=host, port=port, root=store_root, job_id=job_id, per_holder=per_holder)
    return {d.rank: d for d in comm.all_gather_object(mine)}


class AgentSender:
    """Rank ``rank``'s replication to ``peers``, run by its node agent: what ``Replication`` asks of a
    :class:`~moe_ft.replication.sender.ReplicaSender` (``capture``: no optimizer recomputation here).

    The requests to the agent go from a thread of their own, in order: the training step only queues the
    iteration (and its ``B_remote``, read at the step). The client is used by that thread alone while points
    are queued; :meth:`flush`, :meth:`close` and the receiver's calls wait for it to be idle first."""

    capture = None

    def __init__(self, client: AgentClient, *, rank: int, store, peers: Sequence[Destination],
                 select: ReplicaSelect, budget: Callable[[], Optional[int]] | None = None,
                 keep: Callable[[], int] = lambda: KEEP_POINTS) -> None:
        self.client, self.rank, self.store, self.keep = client, rank, store, keep
        self.peers, self.select, self.budget = tuple(peers), select, budget
        self.sent: list[SentRecord] = []
        """The last message the agent sent (of the answer to the last request)."""
        self.deferred: list[int] = []
        self.replicated_iteration: int | None = None
        self.agent_cpu = AgentCpu()
        self._iteration = -1
        self._worker: BackgroundWorker[ReplicateRequest] = BackgroundWorker(
            f"moe-ft-agent-replicate{rank}", lambda req: self._take(self.client.call("replicate", req)),
            describe=lambda e: f"replication of rank {rank} by its node agent failed: {e!r}")

    def submit(self, iteration: int, plan: Mapping[OperatorId, Level] | None = None) -> None:
        """Name point ``iteration`` to the agent (it sends it once published); returns at once."""
        self._worker.raise_if_failed()
        self._iteration = iteration
        if not self.peers:
            return
        budget = max(int(self.budget() or 0), 0) if self.budget is not None else None
        self._worker.submit(ReplicateRequest(
            rank=self.rank, iteration=iteration, store_dir=self.store.backend.describe(), peers=self.peers,
            select=self.select, plan=None if plan is None else dict(plan), budget=budget, keep=self.keep()))

    def _take(self, state: dict) -> None:
        self.replicated_iteration = state["replicated_iteration"]
        self.sent = [SentRecord(*state["sent"])] if state["sent"] is not None else []
        self.deferred = list(state["deferred"])
        self.agent_cpu.take(self._iteration, state["cpu_s"])

    def lag(self, iteration: int) -> int:
        done = self.replicated_iteration
        return iteration - done if done is not None else iteration + 1

    def flush(self) -> None:
        self._worker.drain()
        self._take(self.client.call("replica_flush", self.rank))

    def close(self) -> None:
        """The queued points, then the end of this rank's streams to its peers (named in the request: an agent
        started again after the last point has no sender of this rank, and ends the streams all the same)."""
        self._worker.close()
        self._worker.raise_if_failed()
        if self.peers:
            self._take(self.client.call("replica_close", self.rank, self.peers))

    def abandon(self) -> None:
        """A failed attempt: the points still queued are not named to the agent (the next attempt's
        ``replica_open`` would otherwise meet them after it, and the agent build a sender for a timeline the
        recovery abandoned), and the agent drops this rank's sender without ending its streams (when the
        request thread is still in a call, the client is left to it: the next attempt's first request replaces
        the sender anyway)."""
        self._worker.close(timeout=5, discard=True)
        if not self._worker.alive:
            with contextlib.suppress(OSError, EOFError, RuntimeError):
                self.client.call("replica_abandon", self.rank)


class AgentReceiver:
    """The replicas of ``sources`` that this rank holds, received and published by its node agent."""

    def __init__(self, client: AgentClient, *, rank: int, sources: Sequence[int], store_for) -> None:
        self.client, self.rank, self.sources = client, rank, tuple(sources)
        self._stores = {src: store_for(src) for src in self.sources}
        self.rejections: list[Rejection] = []
        self.torn = 0
        """Messages the agent dropped because their connection ended inside them (a killed sender)."""

    def store(self, owner: int):
        return self._stores[owner]

    def poll(self) -> dict[int, dict]:
        """What arrived so far, per source (also refreshes :attr:`rejections`)."""
        state = self.client.call("replica_state", self.rank)
        streams = state["streams"]
        self.rejections = [r for src in self.sources for r in streams.get(src, {}).get("rejections", [])]
        self.torn = state["torn"]
        return streams

    def join(self, timeout: float | None = None) -> None:
        """Wait until every source's agent ended its stream to this rank."""
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while True:
            streams = self.poll()
            open_ = [src for src in self.sources if not streams.get(src, {}).get("closed")]
            if not open_:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas from rank(s) {open_}: their node agents have not ended their streams")
            time.sleep(0.05)
