"""Spare bookkeeping of ``moe-ft launch``'s agent: this node's warm spares (started, listed in the store,
reaped when they exit), the spares other nodes list, and the mechanism that carries out a replacement plan
(:func:`~moe_ft.launch.policy.plan_replacements`): claiming spares for dead ranks, starting fresh
processes, and giving it all back when the decision fails. A layer of
:class:`~moe_ft.launch.agent.SpareAgent`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from torch.distributed.elastic.agent.server.api import WorkerGroup

from moe_ft.launch import protocol
from moe_ft.launch.membership import JobMembership
from moe_ft.launch.policy import plan_replacements
from moe_ft.launch.state import WorkerProcess

log = logging.getLogger("moe_ft.launch")

SPARE_EXITS = 3
"""Spares of a node that may exit while they wait, without one taking a rank in between, before the node
starts no more (a spare that cannot start, e.g. a broken environment or no free memory, would otherwise be
started again at every monitor pass, each with a log directory of its own). A failed rank then goes to a
fresh process, as with ``--spares-per-node 0``."""


@dataclass
class Claims:
    """What a decision took before it announced (``SpareAgent._assign``), so that a decision that raises gives it
    all back (``SpareAgent._undo``): a spare claimed for a rank that no announcement names never runs it, and the
    next decision finds every spare and device that was free before."""

    store: list[tuple[str, str]] = field(default_factory=list)
    """``(slot, assignment)`` of every spare claimed in the store, this node's and other nodes'."""
    local: list[tuple[int, WorkerProcess, int]] = field(default_factory=list)
    """``(rank, spare, its device before)``: this node's spares given a rank."""
    fresh: list[tuple[int, WorkerProcess]] = field(default_factory=list)
    """``(rank, process)``: processes started for a rank."""
    freed: dict[int, int] = field(default_factory=dict)
    """Dead rank → the device it left, taken by the process planned for it."""


class SpareBookkeeping(JobMembership):
    """This node's spares, and the processes each dead rank is given."""

    def _free_device(self, worker_group: WorkerGroup) -> int | None:
        """The lowest device index no process of this node holds (``None``: all taken)."""
        used = {p.local_rank for p in [*self._workers.values(), *self._spares]}
        free = [i for i in range(worker_group.spec.local_world_size + self._spares_per_node) if i not in used]
        return free[0] if free else None

    def _free_devices(self, worker_group: WorkerGroup) -> int:
        used = {p.local_rank for p in [*self._workers.values(), *self._spares]}
        return len([i for i in range(worker_group.spec.local_world_size + self._spares_per_node) if i not in used])

    def _start_spare(self, worker_group: WorkerGroup, local_rank: int) -> WorkerProcess:
        slot = f"{self._round_tag}.{self._node}.{self._slots}"
        self._slots += 1
        return self._start_one(worker_group, name=f"spare_{slot}", rank=-1, local_rank=local_rank, slot=slot)

    def _reap_spares(self) -> None:
        """Forget the spares that exited while waiting (:meth:`_fill_spares` starts others, up to
        :data:`SPARE_EXITS` in a row)."""
        for spare in list(self._spares):
            if spare.context.wait(0) is not None:
                self._spares.remove(spare)
                self._spare_exits += 1
                if self._spare_exits < SPARE_EXITS:
                    log.warning("moe-ft launch: spare %s exited while waiting; starting another", spare.slot)
                elif self._spare_exits == SPARE_EXITS:
                    log.warning("moe-ft launch: %d spares of this node exited while waiting (the last: %s; see "
                                "their logs): no more spares here, a failed rank goes to a fresh process",
                                SPARE_EXITS, spare.slot)

    def _fill_spares(self, worker_group: WorkerGroup) -> None:
        while len(self._spares) < self._spares_per_node and self._spare_exits < SPARE_EXITS:
            device = self._free_device(worker_group)
            if device is None:  # this node runs a lost node's rank on a former spare's device
                break
            self._spares.append(self._start_spare(worker_group, device))
        self._list_spares(worker_group)

    def _list_spares(self, worker_group: WorkerGroup) -> None:
        """Write this node's waiting spares to ``spares/<node>`` when they changed (in-process only)."""
        if self._inprocess:
            listed = json.dumps([{"slot": p.slot, "local_rank": p.local_rank} for p in self._spares])
            if listed != self._published_spares:
                self._store_client(worker_group).set(self._keys.node_spares(self._node), listed)
                self._published_spares = listed

    def _listed_spares(self, store) -> list[tuple[int, str, int]]:
        """``(node, slot, device)`` of the waiting spares the other live nodes list."""
        out = []
        for node in range(self._nodes):
            if (node == self._node or node in self._lost or self._has_finished(store, node)
                    or not store.check([self._keys.node_spares(node)])):
                continue
            out += [(node, s["slot"], s["local_rank"]) for s in json.loads(store.get(self._keys.node_spares(node)))]
        return out

    def _adopt_claimed_spares(self, worker_group: WorkerGroup) -> None:
        """Spares of this node that another node's agent gave a rank become this node's workers, once the
        attempt that gives it is announced (a claim whose decision failed is released and never taken)."""
        store = self._store_client(worker_group)
        for spare in list(self._spares):
            assignment = protocol.spare_assignment(store, self._keys, spare.slot)
            if assignment is not None and protocol.claim_stands(store, self._keys, spare.slot, assignment):
                self._spares.remove(spare)
                self._workers[assignment["rank"]] = spare

    def _assign(self, worker_group: WorkerGroup, attempt: int, dead: list[int],
                claims: Claims | None = None) -> tuple[dict[int, tuple[int, str]], list[int], list[int]]:
        """Give each dead rank a process as :func:`plan_replacements` orders it, claiming remote spares
        with ``compare_set`` (one another agent claimed first is skipped); every claim, spare and device
        taken is recorded in ``claims`` (:meth:`_undo` gives them back). Returns ``(rank → (node, slot),
        ranks given fresh processes, ranks left without one)``."""
        claims = Claims() if claims is None else claims
        store = self._store_client(worker_group)
        remote = self._listed_spares(store)
        plan, missing = plan_replacements(dead, node=self._node, holders=self._holders,
                                          local_spares=len(self._spares), free_devices=self._free_devices(worker_group),
                                          remote_spares=len(remote))
        assignments: dict[int, tuple[int, str]] = {}
        fresh = []
        for rank, source in plan:
            if source != "remote":
                device = self._freed.pop(rank, None)  # the rank ran here: its successor takes its device
                if device is not None:
                    claims.freed[rank] = device
                proc = self._claim_local(store, attempt, rank, device, claims) if source == "local" else None
                if proc is None and self._holders.get(rank) == self._node:
                    # a fresh process on a free device of this node, imports while the others wait (planned,
                    # or the local spares planned were claimed by other agents meanwhile)
                    device = self._free_device(worker_group) if device is None else device
                    if device is not None:
                        proc = self._start_spare(worker_group, device)
                        fresh.append(rank)
                        claims.fresh.append((rank, proc))
                        claim = protocol.claim_spare(store, self._keys, proc.slot, attempt, rank, proc.local_rank,
                                                     world_size=self._world, group_rank=self._groups[self._node])
                        assert claim is not None, f"spare {proc.slot} was started a moment ago: nobody claimed it"
                        claims.store.append((proc.slot, claim))
                if proc is not None:
                    self._workers[rank] = proc
                    assignments[rank] = (self._node, proc.slot)
                    continue
                if device is not None:  # none here after all: the device stays the rank's for a later pass
                    self._freed[rank] = device
                    del claims.freed[rank]
            while remote:  # a spare another node lists
                node, slot, device = remote.pop(0)
                claim = protocol.claim_spare(store, self._keys, slot, attempt, rank, device, world_size=self._world,
                                             group_rank=self._groups[node])
                if claim is not None:
                    claims.store.append((slot, claim))
                    assignments[rank] = (node, slot)
                    break
            else:
                missing.append(rank)
        return assignments, fresh, missing

    def _claim_local(self, store, attempt: int, rank: int, device: int | None, claims: Claims) -> WorkerProcess | None:
        """Give ``rank`` a spare of this node (``device``: the index the rank's dead process held, which the
        spare takes). Another node's agent may have claimed the spare for a lost node's rank since this
        node's last pass (it is listed in the store): the spare then runs that rank here, as
        :meth:`_adopt_claimed_spares` would have found, and the next one is tried (one whose claim no
        announcement names, left by a fallback, stays a spare). ``None``: none left."""
        kept: list[WorkerProcess] = []
        try:
            while self._spares:
                proc = self._spares.pop(0)
                index = proc.local_rank if device is None else device
                claim = protocol.claim_spare(store, self._keys, proc.slot, attempt, rank, index, world_size=self._world,
                                             group_rank=self._groups[self._node])
                if claim is not None:
                    claims.store.append((proc.slot, claim))
                    claims.local.append((rank, proc, proc.local_rank))
                    self._spare_exits = 0  # spares work here: the bound counts exits in a row
                    proc.local_rank = index  # the spare's own index goes to the next spare started
                    return proc
                taken = protocol.spare_assignment(store, self._keys, proc.slot)
                if taken is not None and protocol.claim_stands(store, self._keys, proc.slot, taken):
                    self._workers[taken["rank"]] = proc
                else:
                    kept.append(proc)
            return None
        finally:
            self._spares[:0] = kept

    def _undo(self, store, claims: Claims) -> None:
        """Give back what a decision that raised took (:class:`Claims`): its claims in the store, this node's
        spares (as spares again, on their own devices), the processes it started for ranks (stopped), and the
        dead ranks' devices."""
        for slot, claim in claims.store:
            protocol.release_spare(store, self._keys, slot, claim)
        for rank, proc, device in reversed(claims.local):
            self._workers.pop(rank, None)
            proc.local_rank = device
            self._spares.insert(0, proc)
        for rank, proc in claims.fresh:
            self._workers.pop(rank, None)
            proc.context.close(timeout=self._shutdown_timeout)
        self._freed.update(claims.freed)

    def _stand_by(self, worker_group: WorkerGroup, rank: int) -> None:
        """Rank ``rank``'s worker stood by (the global batch trains on fewer ranks, ``moe_ft/elastic/standby.py``):
        its process is collected and a warm spare starts on its device, for the next failed rank."""
        proc = self._workers.pop(rank)
        proc.context.close()
        self._surplus.add(rank)
        self._store_client(worker_group).set(self._keys.surplus(self._node), json.dumps(sorted(self._surplus)))
        self._spares.append(self._start_spare(worker_group, proc.local_rank))
        print(f"moe-ft launch: rank {rank} stood by (the global batch trains on fewer ranks): a spare waits on its "
              "device", flush=True)

    def _stood_by(self) -> list[int]:
        """Ranks of the live nodes whose workers stood by (``surplus/<node>``)."""
        store = self._launch_store
        out: list[int] = []
        for node in range(self._nodes):
            if node not in self._lost and store is not None and store.check([self._keys.surplus(node)]):
                out += json.loads(store.get(self._keys.surplus(node)))
        return out
