"""The recovery decisions of ``moe-ft launch``'s agent: for the ranks dead, under the decision lock, announce
the next attempt -- spares or fresh processes take them (in process), the job shrinks, the survivors wait
for a replacement node, or every worker starts again (a fallback) -- as :mod:`~moe_ft.launch.policy`
decides. A layer of :class:`~moe_ft.launch.agent.SpareAgent`.
"""

from __future__ import annotations

import contextlib
import json
import time

from torch.distributed.elastic.agent.server.api import WorkerGroup

from moe_ft.launch import policy, protocol
from moe_ft.launch.membership import join_timeout_s
from moe_ft.launch.spares import Claims, SpareBookkeeping


class RecoveryDecisions(SpareBookkeeping):
    """Decides and announces each attempt that follows a failure."""

    def _decide(self, worker_group: WorkerGroup) -> bool:
        """Announce the next attempt for the dead ranks: ``False`` when the job must restart instead (a
        fallback was announced). Another agent holding the decision lock: try again next pass."""
        store = self._store_client(worker_group)
        attempt = protocol.lock_next(store, self._keys, by=f"node{self._node}")
        if attempt is None:
            return True
        claims = Claims()
        try:
            return self._decide_locked(worker_group, attempt, claims)
        except BaseException:
            # fenced while reading what was announced, a signal, a spare that would not start: the attempt
            # stays unannounced. The spares it claimed go back first (while the lock still keeps every other
            # agent from announcing the attempt), then its lock, or no agent could announce it again (no
            # replacement, no fallback, and the full restart refused). A store that fails here too must not
            # hide the first error.
            with contextlib.suppress(Exception):
                self._undo(store, claims)
            with contextlib.suppress(Exception):
                protocol.release(store, self._keys, attempt)
            raise

    def _decide_locked(self, worker_group: WorkerGroup, attempt: int, claims: Claims) -> bool:
        """:meth:`_decide` once the decision lock of ``attempt`` is held."""
        store = self._store_client(worker_group)
        self._apply_announcements(worker_group)  # what was announced before the lock may cover them
        if not self._dead:
            protocol.release(store, self._keys, attempt)
            return True
        dead, detected = sorted(self._dead), min(self._dead.values())
        if self._remaining_restarts <= 0:  # torchrun's budget: failures the job survives, however recovered
            self._announce_fallback(worker_group, dead, (
                f"--max-restarts {worker_group.spec.max_restarts} spent (every failure counts, replaced in process "
                f"or restarted); rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} failed"), attempt,
                then="the job stops")
            return False
        if self._awaiting:  # the survivors already wait for a replacement node: no second plan on top
            new = sorted(set(dead) - self._awaiting)
            self._announce_fallback(worker_group, dead, (
                f"rank{'s' if len(new) > 1 else ''} {', '.join(map(str, new))} failed while the job waited for "
                f"a replacement of node(s) {sorted(self._lost)}"), attempt)
            return False
        assignments, fresh, missing = self._assign(worker_group, attempt, dead, claims)
        if missing and not assignments and self._can_shrink(dead):
            self._shrink(worker_group, attempt, dead, detected)
            return True
        if missing and not assignments and self._can_await(dead):
            self._await_node(worker_group, attempt, dead, detected)
            return True
        if missing:
            self._announce_fallback(worker_group, dead, (
                f"no spare left for rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                f"lost node(s) {sorted(self._lost)} (--spares-per-node {self._spares_per_node})"), attempt)
            return False
        holders = {rank: node for rank, (node, _) in assignments.items()}
        protocol.publish(store, self._keys, attempt, kind="inprocess", failed=dead, detected_at=detected,
                         holders=holders, lost=sorted(self._lost),
                         slots={rank: slot for rank, (_, slot) in assignments.items()})
        self._holders.update(holders)
        self._dead = {}
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        givers = sorted({node for node, _ in assignments.values()})
        print(f"moe-ft launch: rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} failed; "
              f"attempt {attempt} gives {'them' if len(dead) > 1 else 'it'} to "
              f"{'a fresh process' if fresh else 'spares' if len(dead) > 1 else 'a spare'}"
              f"{'' if givers == [self._node] else ' on node(s) ' + ', '.join(map(str, givers))}, "
              "the other workers keep their processes", flush=True)
        return True

    def _can_shrink(self, dead: list[int]) -> bool:
        """:func:`~moe_ft.launch.policy.can_shrink` for this agent's view (``--nnodes MIN:MAX`` only)."""
        return self._min_nodes is not None and policy.can_shrink(
            dead, min_nodes=self._min_nodes, nodes=self._nodes, lost=self._lost, home=self._home,
            holders=self._holders, stood_by=self._stood_by())

    def _can_await(self, dead: list[int]) -> bool:
        """:func:`~moe_ft.launch.policy.can_await` for this agent's view."""
        return policy.can_await(dead, min_nodes=self._min_nodes, nodes=self._nodes, lost=self._lost,
                                home=self._home, holders=self._holders, stood_by=self._stood_by())

    def _await_node(self, worker_group: WorkerGroup, attempt: int, dead: list[int], detected: float) -> None:
        """Announce that the lost nodes' ranks wait for replacement nodes (kind ``"await"``): the survivors
        leave the attempt, keep their processes and state, and wait up to the rendezvous's join timeout; the
        replacement's agent joins the rendezvous, torch elastic sees a waiting node and ``_restart_workers``
        forms the next round with the survivors' workers kept (``_replacement_attempt``)."""
        wait_s = join_timeout_s(worker_group.spec.rdzv_handler)
        protocol.publish(self._store_client(worker_group), self._keys, attempt, kind="await", failed=dead,
                         detected_at=detected, lost=sorted(self._lost), wait_s=wait_s)
        self._awaiting = set(dead)
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        print(f"moe-ft launch: no spare for ranks {', '.join(map(str, dead))} of lost node(s) {sorted(self._lost)}; "
              f"attempt {attempt}: the other workers keep their processes and wait up to {wait_s:.0f} s for a "
              "replacement node", flush=True)

    def _shrink(self, worker_group: WorkerGroup, attempt: int, dead: list[int], detected: float) -> None:
        """Announce the job without the lost nodes: the live nodes keep their order, their ranks are
        renumbered contiguously (``resize.ranks``: old → new), the world is smaller; the workers keep
        their processes and re-plan as after an elastic restart."""
        resize = policy.shrunk_layout(nodes=self._nodes, lost=self._lost, home=self._home,
                                      per_node=worker_group.spec.local_world_size)
        protocol.publish(self._store_client(worker_group), self._keys, attempt, kind="inprocess", failed=dead,
                         detected_at=detected, lost=sorted(self._lost), resize=resize)
        self._apply_resize(json.loads(json.dumps(resize)), dead)
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        print(f"moe-ft launch: no spare for ranks {', '.join(map(str, dead))} of lost node(s) "
              f"{sorted(self._lost)}; attempt {attempt} shrinks the job to {resize['world_size']} ranks on "
              f"{len(resize['nodes'])} node(s), the workers keep their processes", flush=True)

    def _announce_fallback(self, worker_group: WorkerGroup, failed: list[int], reason: str,
                           attempt: int | None = None, then: str = "every worker starts again",
                           recovery_gave_up: bool = False) -> None:
        """Tell every worker to leave for a full restart (kind ``"fallback"``); ``attempt``: the decision
        lock already held. Another agent deciding meanwhile: its attempt stands, the restart follows anyway.
        ``recovery_gave_up``: the workers could not go on in the attempt before (they gave up forming it, or
        stopped on purpose in it); when that attempt spent a restart for its failure, the announcement says
        so (``spent_by``) and every agent gives that restart back (:meth:`_refund_recovery`)."""
        store = self._store_client(worker_group)
        if attempt is None:
            newest = protocol.current_attempt(store, self._keys)
            if protocol.announcement(store, self._keys, newest).get("kind") == "fallback":
                # another agent's fallback is what made these workers leave: one full restart covers both,
                # and its reason (the first cause) stays the one the report shows
                print(f"moe-ft launch: {reason}: the full restart of attempt {newest} covers it", flush=True)
                self._seen = self._attempt = newest
                self._falling_back = True
                return
            attempt = protocol.lock_next(store, self._keys, by=f"node{self._node}")
        if attempt is None:
            return
        extra = {}
        if recovery_gave_up and policy.spends_restart(protocol.announcement(store, self._keys, attempt - 1)):
            extra["spent_by"] = attempt - 1
        protocol.publish(store, self._keys, attempt, kind="fallback", failed=failed,
                         detected_at=min(self._dead.values(), default=time.time()), reason=reason, **extra)
        print(f"moe-ft launch: {reason}: {then}", flush=True)
        self._seen = self._attempt = attempt
        self._falling_back = True

    def _refund_recovery(self, worker_group: WorkerGroup) -> None:
        """One failure spends one of ``--max-restarts``, however it is recovered. When the in-process attempt
        that spent one for a failure falls back (the fallback says ``spent_by``), the full restart torch
        elastic is about to spend another on is the same failure's: give one back (once per fallback), so
        that ``--max-restarts 1`` survives one failure whose in-process recovery fell back."""
        info = protocol.announcement(self._store_client(worker_group), self._keys, self._seen)
        if info.get("kind") == "fallback" and "spent_by" in info and self._refunded != self._seen:
            self._refunded = self._seen
            self._remaining_restarts = min(self._remaining_restarts + 1, worker_group.spec.max_restarts)
