"""Background sender: after the snapshot engine publishes point ``t`` in the node-local store, read its
entry files and send them to this rank's replica peers (``placement.py``), on a thread of its own.

``submit(t)`` only enqueues an iteration number, so the training step never waits for the network;
the point is pinned in the store while it is read. Points that garbage collection removed before the
sender got to them (replication slower than snapshots) are skipped and counted. ``lag(t)`` is the number
of iterations the newest replicated point is behind ``t`` (logged in the FT line).

**Remote budget** (MoEtion §4.2, ``B_remote = BW_net × T_iter``): with ``budget`` set, each submitted
iteration adds ``budget()`` bytes of credit and the sender spends credit on what it sends (payload summed
over the peers, the bytes leaving this rank), so after ``n`` submitted iterations at most
``Σ B_remote`` bytes have left the rank. It replicates the *newest recovery point first*: it asks the
store for the newest point its retention rule completes at or before the newest published iteration
(``SnapshotStore.newest_recoverable``), adds the newer points of the recovery point in flight (the rest
of a sparse window), and sends the ones not sent yet, newest first, while they fit the credit; points
older than that recovery point are abandoned (``deferred``), never sent late. ``submit(t, plan)``
restricts point ``t`` to the operators ``plan`` saves FULL (selective's ``remote_plan``; the metadata
entry always goes). ``lag(t)`` is then ``t`` minus the end of the newest recovery point whose every point
reached the peers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from moe_ft.background import BackgroundWorker
from moe_ft.replication.transport import PeerUnreachable, PointMessage, PointSink
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore
from moe_ft.store.backend import MANIFEST
from moe_ft.store.codec import PENDING
from moe_ft.store.errors import StoreError
from moe_ft.store.manifest import EntryRecord, PointRecord, decode_manifest

logger = logging.getLogger("moe_ft.replication")


def end_streams(transport: PointSink, peers: Sequence[int], *, owner: int) -> None:
    """Tell each of ``peers`` that rank ``owner``'s stream ends. A peer unreachable now is logged, not raised:
    the end of training goes on (that holder's wait for the end of the stream names the source it missed)."""
    for peer in peers:
        try:
            transport.close_to(peer)
        except PeerUnreachable as exc:
            logger.warning("moe-ft replication rank %d: the end of the stream to peer %d not sent: %s", owner, peer,
                           exc)


_UNREADABLE = (StoreError, OSError)
"""What reading a local point raises when it is damaged (a manifest or entry that fails verification, a file
that cannot be read): the point is skipped and logged, as garbage collection's are, not a sticky error of the
sender (every later point, and every later attempt served by the same node agent, would fail with it)."""


@dataclass(kw_only=True)
class SenderConfig:
    publish_timeout_s: float = 300.0
    """How long the sender waits for a submitted iteration to be published before skipping it."""
    poll_s: float = 0.002
    """Polling period while waiting for the publish (the engine publishes on its own thread)."""


@dataclass(frozen=True)
class SentRecord:
    iteration: int
    nbytes: int  # payload bytes, summed over peers
    num_entries: int
    seconds: float


class ReplicaSender:
    """Replicates this rank's published points to ``peers`` over ``transport``. ``select(entry)`` decides
    which operator entries are sent (``needs_replication``); the metadata entry always is. ``budget``:
    ``B_remote`` in bytes per iteration (called at each submit, so it may follow ``T_iter``), ``None`` for
    no limit; see the module docstring."""

    def __init__(self, config: SenderConfig, store: SnapshotStore, transport: PointSink, peers: Sequence[int], *,
                 owner: int, select: Callable[[EntryRecord], bool] | None = None,
                 budget: Callable[[], Optional[int]] | None = None) -> None:
        self.config, self.store, self.transport = config, store, transport
        self.peers, self.owner = tuple(peers), owner
        self.select = select or (lambda entry: True)
        self.budget = budget
        self.sent: list[SentRecord] = []
        self.skipped: list[tuple[int, str]] = []
        self.deferred: list[int] = []
        """Budgeted: points abandoned because a newer recovery point superseded them before they fit."""
        self.submitted_iteration: int | None = None
        self.replicated_iteration: int | None = None
        self.credit = 0
        """Budgeted: bytes the sender may still send (``Σ budget()`` over submits − bytes sent)."""
        self._plans: dict[int, frozenset[OperatorId]] = {}
        self._done: set[int] = set()  # budgeted: points already on every peer
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._worker: BackgroundWorker[int] = BackgroundWorker(
            f"moe-ft-replica-send{owner}", self._replicate_point,
            describe=lambda e: f"replication of rank {self.owner} to {list(self.peers)} failed: {e!r}")

    # -- training thread ---------------------------------------------------------------------------------
    def submit(self, iteration: int, plan: Mapping[OperatorId, Level] | None = None) -> None:
        """Replicate point ``iteration`` once it is published (returns at once). ``plan``: send only the
        operators it saves FULL (MoEtion's remote plan) instead of every entry of the point."""
        self._raise_if_failed()
        self.submitted_iteration = iteration
        if not self.peers:
            return
        with self._lock:
            if plan is not None:
                self._plans[iteration] = frozenset(op for op, lvl in plan.items() if lvl == Level.FULL)
            if self.budget is not None:
                self.credit += max(int(self.budget() or 0), 0)
        self._worker.submit(iteration)

    def lag(self, iteration: int) -> int:
        """Iterations between ``iteration`` and the newest point fully sent to every peer."""
        done = self.replicated_iteration
        return iteration - done if done is not None else iteration + 1

    def flush(self) -> None:
        """Block until every submitted point is sent (tests, end of training)."""
        self._worker.drain()

    def close(self) -> None:
        """Send what is queued, then tell the peers that this stream ends."""
        if not self._worker.alive:
            return
        self._worker.close()
        end_streams(self.transport, self.peers, owner=self.owner)
        self._raise_if_failed()

    def abandon(self) -> None:
        """Stop after what is queued without ending the peers' streams (a failed attempt's sender, which a
        new one replaces; returns at once)."""
        self._worker.close(timeout=0)

    def _raise_if_failed(self) -> None:
        self._worker.raise_if_failed()

    # -- sender thread -----------------------------------------------------------------------------------
    def _replicate_point(self, iteration: int) -> None:
        if self.budget is None:
            self._replicate(iteration)
        else:
            self._replicate_budgeted(iteration)

    def _wait_published(self, iteration: int) -> str:
        """'' once point ``iteration`` is published, else why it will not be sent: a newer point is published
        and ``iteration`` is not (garbage collection took it first, or it was never published), or the
        timeout passed."""
        deadline = time.monotonic() + self.config.publish_timeout_s
        while iteration not in (points := self.store.points()):
            if points and max(points) > iteration:
                return (f"superseded: point {max(points)} is published and {iteration} is not (deleted by garbage "
                        "collection before it was read, or never published)")
            if time.monotonic() > deadline:
                return f"not published within {self.config.publish_timeout_s:.0f} s"
            time.sleep(self.config.poll_s)
        return ""

    def _skip(self, iteration: int, why: str) -> None:
        with self._lock:  # never sent now: its plan is not needed any more
            self._plans.pop(iteration, None)
        self.skipped.append((iteration, why))
        logger.warning("moe-ft replication rank %d: point %d not replicated: %s", self.owner, iteration, why)

    def _chosen(self, iteration: int, record: PointRecord) -> list[EntryRecord]:
        with self._lock:
            plan = self._plans.get(iteration)
        return [e for e in record.all_entries()
                if e.op is None or (self.select(e) and (plan is None or e.op in plan))]

    def _read(self, iteration: int) -> PointMessage:
        """The message for point ``iteration`` (its chosen entries); ``FileNotFoundError`` if GC took it, and
        see :data:`_UNREADABLE`."""
        backend = self.store.backend
        with self.store.pin([iteration]):
            manifest = backend.read_blob(iteration, MANIFEST)
            where = f"{backend.describe()} iteration {iteration}"
            record = decode_manifest(manifest, iteration, where)
            if any(e.checksum == PENDING for e in record.all_entries()):  # --ft-checksum-by agent: the peers
                manifest = self.store.manifest_with_digests(iteration, manifest)  # verify against real digests
                record = decode_manifest(manifest, iteration, where)
            blobs = {e.blob: backend.read_blob(iteration, e.blob) for e in self._chosen(iteration, record)}
        return PointMessage(owner=self.owner, iteration=iteration, manifest=manifest, blobs=blobs)

    def _send(self, message: PointMessage, start: float) -> bool:
        """Send ``message`` to every peer; whether it reached them all (a peer the transport cannot reach
        now, :class:`PeerUnreachable`, misses this point: skipped for it, and the point does not count as
        replicated)."""
        nbytes, missed = 0, []
        for peer in self.peers:
            try:
                nbytes += self.transport.send_point(peer, message)
            except PeerUnreachable as exc:
                missed.append((peer, exc))
        self.sent.append(SentRecord(message.iteration, nbytes, len(message.blobs), time.perf_counter() - start))
        with self._lock:
            self._plans.pop(message.iteration, None)
        if missed:
            self._skip(message.iteration, f"peer(s) {[p for p, _ in missed]} unreachable: {missed[0][1]}")
        return not missed

    def _replicate(self, iteration: int) -> None:
        if why := self._wait_published(iteration):
            return self._skip(iteration, why)
        start = time.perf_counter()
        try:
            message = self._read(iteration)
        except FileNotFoundError:
            return self._skip(iteration, "deleted by garbage collection before it was read "
                                         "(replication slower than snapshots)")
        except _UNREADABLE as exc:
            return self._skip(iteration, f"unreadable here: {exc!r}")
        if self._send(message, start):
            self.replicated_iteration = iteration

    def _wanted(self, newest: int) -> tuple[list[int], Optional[int]]:
        """Points of the newest recovery point at or before ``newest`` and of the one in flight after it
        (newest first), and that recovery point's end (``None``: no complete one yet: every point)."""
        rule = getattr(self.store.retention, "rule", None)
        published = [it for it in self.store.points() if it <= newest]
        point = self.store.newest_recoverable(rule, at_or_before=newest) if rule is not None else None
        if rule is None:  # no completeness rule: each point stands alone
            return [newest] if newest in published else [], newest
        if point is None:
            return sorted(published, reverse=True), None
        wanted = set(point.iterations) | {it for it in published if it > point.end}
        return sorted(wanted, reverse=True), point.end

    def _replicate_budgeted(self, iteration: int) -> None:
        if why := self._wait_published(iteration):
            return self._skip(iteration, why)
        if self._worker.has_pending():  # behind: a newer point is queued, plan from the newest one
            return
        wanted, end = self._wanted(iteration)
        abandoned = [it for it in self.store.points() if it < min(wanted, default=iteration + 1)
                     and it not in self._done and it not in self.deferred]
        self.deferred.extend(abandoned)
        for it in (w for w in wanted if w not in self._done):
            start = time.perf_counter()
            try:
                message = self._read(it)
            except FileNotFoundError:
                self._skip(it, "deleted by garbage collection before it was read")
                continue
            except _UNREADABLE as exc:
                self._skip(it, f"unreadable here: {exc!r}")
                continue
            cost = message.nbytes * len(self.peers)
            with self._lock:
                if cost > self.credit:
                    break  # keep the credit: the next iteration adds to it
                self.credit -= cost
            if self._send(message, start):
                self._done.add(it)
        complete = [e for e in ([end] if end is not None else [])
                    if all(w in self._done for w in wanted if w <= e)]
        if complete:
            self.replicated_iteration = complete[0]
        oldest = min(wanted, default=0)
        self._done = {it for it in self._done if it >= oldest}
        with self._lock:  # points older than every wanted one are never sent: their plans go
            for it in [it for it in self._plans if it < oldest]:
                del self._plans[it]
