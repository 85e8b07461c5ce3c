"""Membership of ``moe-ft launch``'s nodes: the attempt of each rendezvous round (a full restart, a node that
joins, a replacement node), the attempts other agents announced (who runs which rank, which nodes are lost,
a shrink), and the heartbeat watch that declares a silent node lost. A layer of
:class:`~moe_ft.launch.agent.SpareAgent`.
"""

from __future__ import annotations

import json
import logging
import os
import time

from torch.distributed.elastic.agent.server.api import WorkerGroup

from moe_ft.launch import protocol
from moe_ft.launch.policy import spends_restart
from moe_ft.launch.processes import ProcessSupervision
from moe_ft.launch.state import NodeWatch

log = logging.getLogger("moe_ft.launch")


class Fenced(RuntimeError):
    """The other agents declared this node lost: it stopped its workers and leaves the job (the rendezvous
    stays open for the others)."""


class JobMembership(ProcessSupervision):
    """The agents' shared view of the job: rounds, announcements, liveness."""

    def _round_attempt(self, worker_group: WorkerGroup, renumber: dict[int, int]) -> int:
        """The attempt of the rendezvous round just formed, the same on every node: each agent posts which
        of its workers stayed (``member/<r>/<node>``: old rank → new rank); node 0's agent announces either
        the grown job (kind ``"inprocess"``, ``resize``) when some did, or a full restart (``_job_attempt``),
        and sets ``round/<r>``; the others read it."""
        store = self._store_client(worker_group)
        rdzv_round = rendezvous_round(worker_group.spec.rdzv_handler)
        store.set(self._keys.member(rdzv_round, self._node), json.dumps({str(o): n for o, n in renumber.items()}))
        key = self._keys.round(rdzv_round)
        if self._node != 0:
            return int(store.get(key))  # waits for node 0's agent
        posts = [json.loads(store.get(self._keys.member(rdzv_round, n))) for n in range(self._nodes)]
        ranks = {old: new for post in posts for old, new in post.items()}
        previous = protocol.announcement(store, self._keys, protocol.current_attempt(store, self._keys))
        if not ranks:
            attempt = self._job_attempt(worker_group)
        elif previous.get("kind") == "await":
            attempt = self._replacement_attempt(worker_group, posts, previous)
        else:
            grown = [n for n, post in enumerate(posts) if not post]
            resize = {"ranks": ranks, "world_size": self._world, "nodes": {str(n): n for n in range(self._nodes)}}
            attempt = protocol.announce(store, self._keys, kind="inprocess", failed=[], detected_at=time.time(),
                                        by="node0", resize=resize, grown=grown)
            print(f"moe-ft launch: node(s) {grown} joined; attempt {attempt} grows the job to {self._world} ranks "
                  f"on {self._nodes} nodes, the other workers keep their processes", flush=True)
        store.set(key, str(attempt))
        return attempt

    def _replacement_attempt(self, worker_group: WorkerGroup, posts: list[dict], waited: dict) -> int:
        """Node 0's agent, in the round a replacement node joined after an ``"await"`` attempt (``waited``):
        announce the attempt in which the joining nodes run the lost nodes' ranks. Every survivor node keeps
        its place in the layout (its posted ranks); the joining nodes (empty posts) take the places left, in
        round order (``nodes``: round node → the group rank its workers see)."""
        per_node = worker_group.spec.local_world_size
        places = {n: {int(old) // per_node for old in post} for n, post in enumerate(posts) if post}
        joining = [n for n, post in enumerate(posts) if not post]
        free = sorted(set(range(self._nodes)) - {p for ps in places.values() for p in ps})
        if any(len(ps) != 1 for ps in places.values()) or len(joining) != len(free):
            raise RuntimeError(f"moe-ft launch: the round after the wait for a replacement node has survivor "
                               f"places {places} and joining nodes {joining} for free places {free}: the layout "
                               "cannot be kept; restart the job")
        nodes = {**{n: next(iter(ps)) for n, ps in places.items()}, **dict(zip(joining, free))}
        holders = {rank: n for n, g in nodes.items() for rank in range(g * per_node, (g + 1) * per_node)}
        attempt = protocol.announce(self._store_client(worker_group), self._keys, kind="inprocess",
                                    failed=waited.get("failed", []), detected_at=waited.get("detected_at", time.time()),
                                    by="node0", nodes=nodes, holders=holders, replaced=free)
        print(f"moe-ft launch: replacement node(s) {joining} joined; attempt {attempt} gives them the ranks "
              f"{', '.join(map(str, waited.get('failed', [])))} of the lost node(s), the other workers keep their "
              "processes", flush=True)
        return attempt

    def _job_attempt(self, worker_group: WorkerGroup) -> int:
        """The attempt of a start of the whole group: 0 for the job's first, else the next one, which node
        0's agent announces (kind ``"job"``, with the reason of the fallback before it) for the rendezvous
        round and the other nodes' agents read."""
        store = self._store_client(worker_group)
        if not self._started and protocol.current_attempt(store, self._keys) == 0:
            return 0
        # the other nodes' agents find the attempt under the rendezvous round; one node has nobody to tell
        # (and torchrun's default static rendezvous has no rounds)
        key = self._keys.round(rendezvous_round(worker_group.spec.rdzv_handler)) if self._nodes > 1 else None
        if self._node != 0:
            return int(store.get(key))
        previous = protocol.announcement(store, self._keys, protocol.current_attempt(store, self._keys))
        reason = previous.get("reason", "") if previous.get("kind") == "fallback" else ""
        attempt = protocol.announce(store, self._keys, kind="job", failed=sorted(w.global_rank for w in worker_group.workers),
                                    detected_at=time.time(), by="node0", reason=reason)
        if key is not None:
            store.set(key, str(attempt))
        return attempt

    def _apply_announcements(self, worker_group: WorkerGroup) -> None:
        """Take in the attempts other agents announced: who runs which rank, which nodes are lost; ranks
        they replaced are no longer this agent's to replace."""
        store = self._store_client(worker_group)
        newest = protocol.current_attempt(store, self._keys)
        for attempt in range(self._seen + 1, newest + 1):
            info = protocol.announcement(store, self._keys, attempt)
            if self._node in info.get("lost", []):  # fenced: the others gave this node's ranks away
                self._close_all()
                raise Fenced(f"moe-ft launch: node {self._node} was declared lost in attempt {attempt} (its "
                             "heartbeat stood still past --node-timeout); its workers are stopped so that no "
                             "rank runs twice")
            if spends_restart(info):  # another agent replaced failed ranks, or made the survivors wait for a
                self._remaining_restarts -= 1  # replacement node: the job's budget is spent by one
            if info.get("kind") == "await":
                self._lost.update(info.get("lost", []))
                self._awaiting = set(info.get("failed", []))
            self._falling_back = self._falling_back or info.get("kind") == "fallback"
            if info.get("kind") == "inprocess":
                self._lost.update(info.get("lost", []))
                if "resize" in info:
                    self._apply_resize(info["resize"], info.get("failed", []))
                    continue
                self._holders.update({int(r): n for r, n in info.get("holders", {}).items()})
                for rank in info.get("failed", []):
                    self._dead.pop(rank, None)
            self._attempt = max(self._attempt, attempt)
        self._seen = max(self._seen, newest)

    def _apply_resize(self, resize: dict, failed: list[int]) -> None:
        """Take in a shrink (JSON form: string keys) whose announcement covers the dead ranks ``failed``: this
        node's workers under their new ranks. A rank that died here since the shrink was decided (not among
        ``failed``) stays dead under its new number, for this agent's next decision: forgotten, it had no
        process and nobody replaced it."""
        ranks = {int(old): new for old, new in resize["ranks"].items()}
        for rank in sorted(set(self._workers) - set(ranks)):  # refused by policy.only_lost_nodes: never left running
            log.warning("moe-ft launch: the shrink drops rank %d, which runs on this node: its worker is stopped",
                        rank)
            self._workers[rank].context.close(timeout=self._shutdown_timeout)
        self._workers = {ranks[r]: p for r, p in self._workers.items() if r in ranks}
        self._home = {ranks[r]: n for r, n in self._home.items() if r in ranks}
        self._holders = dict(self._home)
        self._dead = {ranks[r]: seen for r, seen in self._dead.items() if r in ranks and r not in failed}
        self._freed = {ranks[r]: device for r, device in self._freed.items() if r in ranks and r not in failed}
        self._world, self._groups = int(resize["world_size"]), {int(n): g for n, g in resize["nodes"].items()}

    def _beat_and_watch(self, worker_group: WorkerGroup) -> None:
        """Bump this node's heartbeat; declare the watched node lost when its heartbeat stood still for
        ``--node-timeout`` (its ranks join the dead ones).

        The silence is counted from this agent's reads, each gap between two reads for at most half the
        timeout. A pause of the watcher, or of the store that every agent beats through, shows up as one long
        gap after which the watched counter has not moved yet (the watched agent was held up as well): no
        evidence that the node is gone. A lost node is still declared, after two reads at the least however
        slow the passes. Measured on a loaded machine: the drills' rendezvous store stalled about 5 s for
        every agent at once, and each agent then declared its neighbour lost."""
        store = self._store_client(worker_group)
        store.add(self._keys.beat(self._node), 1)
        live = [n for n in range(self._nodes) if n not in self._lost]
        after = [n for n in live if n > self._node] + [n for n in live if n < self._node]
        node = next((n for n in after if not self._has_finished(store, n)), None)
        if node is None:
            return
        beat = int(store.add(self._keys.beat(node), 0))
        now = time.monotonic()
        watch = self._watch
        if watch is None or watch.node != node or watch.beat != beat:
            self._watch = NodeWatch(node, beat, since=now, seen=now)
            return
        timeout = self._node_timeout_s
        if int(store.add(self._keys.suspect(self._seen), 0)):  # a worker saw a peer fail in this attempt
            timeout = max(protocol.MIN_SUSPECT_TIMEOUT_S, timeout / protocol.SUSPECT_FACTOR)
        watch.silent += min(now - watch.seen, timeout / 2)
        watch.seen = now
        if watch.silent < timeout:
            return
        self._lost.add(node)
        seen = time.time()
        for rank, holder in self._holders.items():
            if holder == node:
                self._dead.setdefault(rank, seen)
        print(f"moe-ft launch: node {node} sent no heartbeat for {now - watch.since:.1f} s: lost "
              f"(ranks {sorted(r for r, h in self._holders.items() if h == node)})", flush=True)
        self._watch = None

    def _has_finished(self, store, node: int) -> bool:
        """Whether ``node``'s workers all finished in this round (``finished/<round>/<node>``): its agent waits in
        the exit barrier, and leaves once the barrier is done or its wait ran out. Either way it is no failure:
        nobody watches it, declares it lost or gives its ranks away."""
        if node not in self._finished_nodes and store.check([self._keys.finished(self._round_tag, node)]):
            self._finished_nodes.add(node)
        return node in self._finished_nodes


def round_or_pid(handler) -> str:
    """The rendezvous round (``r<n>``), or this agent's pid (``p<pid>``) under a handler without rounds."""
    try:
        return f"r{rendezvous_round(handler)}"
    except RuntimeError:
        return f"p{os.getpid()}"


def join_timeout_s(handler) -> float:
    """The rendezvous's join timeout (``--rdzv-conf join_timeout``, torch's default 600 s): how long the
    survivors wait for a replacement node."""
    try:
        return float(handler._settings.timeout.join.total_seconds())
    except AttributeError:
        return 600.0


def rendezvous_round(handler) -> int:
    """The rendezvous round the agents just completed (torch 2.13's ``DynamicRendezvousHandler`` keeps it
    in its state holder): the same number on every node, so it names the full restart's attempt."""
    try:
        return int(handler._state_holder.state.round)
    except AttributeError:
        raise RuntimeError("moe-ft launch needs the c10d/etcd-v2 dynamic rendezvous (torch 2.13's "
                           "DynamicRendezvousHandler) to number full restarts across nodes") from None
