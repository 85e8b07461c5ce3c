"""Background writer of the durable tier (MoC §5.1): every ``interval`` iterations it takes the newest
recovery point of the node-local store that the policy's rule accepts, copies the entries it needs —
verified against their checksums on the way — into :class:`DurableTier`, and marks this rank's part done;
the last rank to finish makes the point complete. The training thread only enqueues an iteration.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Mapping

from moe_ft.background import BackgroundWorker
from moe_ft.persist.durable import DurableTier
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore
from moe_ft.store.codec import PENDING
from moe_ft.store.errors import store_full
from moe_ft.store.manifest import EntryRecord, PointRecord, build_manifest
from moe_ft.store.rules import EntryRef, RecoveryPoint, RecoveryRule

log = logging.getLogger("moe_ft.persist")


@dataclass(frozen=True)
class PersistRecord:
    end: int
    nbytes: int
    seconds: float
    complete: bool


class PersistWriter:
    def __init__(self, store: SnapshotStore, tier: DurableTier, rule: RecoveryRule, *, rank: int, interval: int,
                 keep: int = 2, publish_timeout: float = 300.0) -> None:
        """Every ``interval`` iterations into ``tier``, keeping ``keep`` complete points, waiting at most
        ``publish_timeout`` seconds for a due point to be published (``DurableConfig`` holds the flags)."""
        if interval < 0 or keep < 1 or publish_timeout < 0:
            raise ValueError(f"durable writer: interval {interval} >= 0, keep {keep} >= 1 (the newest complete point "
                             f"is never deleted) and publish timeout {publish_timeout} >= 0 needed")
        self.interval, self.keep, self.publish_timeout = interval, keep, publish_timeout
        self.store, self.tier, self.rule, self.rank = store, tier, rule, rank
        self.durable = tier.store(rank)
        # the durable store keeps no retention of its own (the tier's markers decide), so nothing else ever
        # removes a point's staging left by a writer killed mid-copy: swept when a writer starts and after
        # every flush (staging of a live writer stays)
        self.durable.backend.sweep_staging()
        self.records: list[PersistRecord] = []
        self.skipped: list[tuple[int, str]] = []
        self.paused = ""
        """Non-empty while the durable copies are paused: the durable directory is full (``ENOSPC``/``EDQUOT``)."""
        self._worker: BackgroundWorker[tuple[int, Mapping[OperatorId, Level] | None]] = BackgroundWorker(
            f"moe-ft-persist{rank}", self._persist_job,
            describe=lambda e: f"durable persistence of rank {self.rank} failed: {e!r}")

    def due(self, iteration: int) -> bool:
        return bool(self.interval) and (iteration + 1) % self.interval == 0

    def submit(self, iteration: int, persist_plan: Mapping[OperatorId, Level] | None = None) -> None:
        """If ``iteration`` is due, persist (in the background) the newest recovery point at or before it —
        or, with ``persist_plan`` (``pec``: ``policy.persist_plan``, K_persist experts per layer, MoC §5.1),
        only those entries of point ``iteration``; the durable point is then each operator's newest
        durable FULL (the rule). Returns at once."""
        self._worker.raise_if_failed()
        if self.due(iteration):
            self._worker.submit((iteration, persist_plan))

    def flush(self) -> None:
        self._worker.drain()

    def settle(self) -> None:
        """Before the runtime discards an abandoned timeline from the tier. The in-process writer does not
        wait here: a queued copy may wait for a point that will never be published (up to
        ``publish_timeout``); the node agent's writer (``moe_ft/agent/persist.py``) is sent published
        points only and does wait."""

    def close(self) -> None:
        self._worker.close()

    def _persist_job(self, job: tuple[int, Mapping[OperatorId, Level] | None]) -> None:
        self._wait_published(job[0])
        self.persist(*job)

    def _wait_published(self, iteration: int) -> None:
        """The engine publishes on its own thread; persist the point of ``iteration`` once it is there
        (if it never comes, the newest older point is persisted)."""
        deadline = time.monotonic() + self.publish_timeout
        while iteration not in self.store.points() and time.monotonic() < deadline:
            time.sleep(0.002)

    def persist(self, iteration: int, persist_plan: Mapping[OperatorId, Level] | None = None) -> PersistRecord | None:
        """Synchronous body of one flush (the thread calls it; tests may too). A durable directory without room
        (``ENOSPC``, ``EDQUOT``) pauses the copies instead of ending the run (:meth:`_pause`)."""
        try:
            record = self._persist(iteration, persist_plan)
        except OSError as e:
            if not store_full(e):
                raise
            self._pause(iteration, e)
            return None
        if self.paused and record is not None:
            print(f"moe-ft durable copies resumed at iteration {iteration}: {self.tier.directory} has room again",
                  file=sys.stderr, flush=True)
            self.paused = ""
        return record

    def _pause(self, iteration: int, error: OSError) -> None:
        """The durable directory is full: this flush is dropped (its staging was aborted, and a marker is
        written whole or not at all: nothing torn is ever marked done or complete), training goes on, the
        next due iteration tries again. Recovery meanwhile uses the newest complete point kept (retention
        deletes old points only after a newer one is complete)."""
        self.skipped.append((iteration, f"durable directory full: {error.strerror}"))
        if not self.paused:
            newest = self.tier.complete_points()
            kept = f"the newest complete durable point (iteration {newest[-1]}) is kept" if newest else \
                "no durable point is complete yet"
            print(f"moe-ft durable copies paused (persist dir full) at iteration {iteration} on rank {self.rank}: "
                  f"{self.tier.directory}: {error.strerror}; training goes on, {kept}, copies resume when space "
                  f"returns (free space there, or --ft-persist-dir on a larger file system)", file=sys.stderr,
                  flush=True)
        self.paused = "persist dir full"

    def _persist(self, iteration: int, persist_plan: Mapping[OperatorId, Level] | None) -> PersistRecord | None:
        start = time.perf_counter()
        if persist_plan is not None:
            return self._persist_incremental(iteration, persist_plan, start)
        with contextlib.ExitStack() as pins:
            # pinned before its bytes are verified and read: the node-local retention may delete any point
            # it does not see pinned, between a listing and the pin (the listing says nothing of such a point)
            point = self.store.newest_recoverable(self.rule, at_or_before=iteration, report=False)
            if point is None:
                self.skipped.append((iteration, "no recovery point in the node-local store yet"))
                return None
            for _ in range(2):  # the newest point; once more, an older one if an entry of it is corrupt
                pins.enter_context(self.store.pin(point.iterations))
                if not set(point.iterations) <= set(self.store.points()):
                    return self._skip(iteration, f"the node-local retention deleted point {point.end} before it "
                                                 "was pinned (newer points superseded it); the next due iteration "
                                                 "copies a newer one")
                verified = self.store.newest_recoverable(self.rule, at_or_before=point.end, verify=True, report=False)
                if verified is None:
                    return self._skip(iteration, "no recovery point of the node-local store verifies")
                if set(verified.iterations) <= set(point.iterations):
                    point = verified
                    break
                point = verified  # verified before it was pinned: pinned now, and its presence checked again
            else:
                return self._skip(iteration, "the node-local points changed while they were verified")
            nbytes = sum(self._copy(point, it) for it in point.iterations)
        return self._finish(point, nbytes, start)

    def _skip(self, iteration: int, why: str) -> None:
        """One line for a flush that copies nothing (the next due iteration tries again)."""
        self.skipped.append((iteration, why))
        log.warning("moe-ft durable copy of iteration %d skipped on rank %d: %s", iteration, self.rank, why)

    def _persist_incremental(self, iteration: int, plan: Mapping[OperatorId, Level], start: float):
        refs = tuple(EntryRef(iteration, op, Level(level)) for op, level in sorted(plan.items())
                     if level != Level.NONE) + (EntryRef(iteration),)
        with self.store.pin([iteration]):
            nbytes = self._copy(RecoveryPoint(iteration, iteration, {}, refs), iteration)
        point = self.durable.newest_recoverable(self.rule, at_or_before=iteration)
        if point is None:  # some operator has no durable FULL yet: nothing complete to mark
            self.records.append(PersistRecord(iteration, nbytes, time.perf_counter() - start, False))
            return self.records[-1]
        return self._finish(point, nbytes, start)

    def _finish(self, point: RecoveryPoint, nbytes: int, start: float) -> PersistRecord:
        complete = self.tier.mark_done(self.rank, point)
        self.tier.gc(self.rank, self.keep)
        self.durable.backend.sweep_staging()
        record = PersistRecord(point.end, nbytes, time.perf_counter() - start, complete)
        self.records.append(record)
        return record

    def _copy(self, point: RecoveryPoint, iteration: int) -> int:
        """Copy the entries of ``point`` at ``iteration`` (verified) into the durable store."""
        wanted = {(ref.op, ref.level) for ref in point.entries if ref.iteration == iteration}
        source = self.store.catalog([iteration]).point(iteration)
        if self.store.records_digests and any(e.checksum == PENDING for e in source.all_entries()):
            # digests deferred to the node agent (this process, on a copy requested before the point's
            # hashing ran): hash it now, so that the durable manifest carries digests, never pending ones
            self.store.record_verified(iteration)
            source = self.store.catalog([iteration]).point(iteration)
        entries = [e for e in source.entries.values() if (e.op, e.level) in wanted]
        meta = source.meta if (None, None) in wanted else None
        if iteration in self.durable.points():
            held = self.durable.catalog([iteration]).point(iteration)
            if held is not None and _holds(held, source, entries + ([meta] if meta else [])):
                return 0  # already durable (a sparse window shared by consecutive flushes)
            # missing entries, or other bytes: another run (a rank killed before its done marker, the job
            # relaunched fresh) or an abandoned timeline wrote this iteration; never mix them into the point,
            # nor leave a point marked complete while its parts come from two timelines
            self.tier.unmark(self.rank, iteration)
            self.durable.delete_point(iteration)
        writer = self.durable.backend.begin_point(iteration)
        nbytes = 0
        try:
            for entry in entries + ([meta] if meta else []):
                # read once, verified: never make a corrupt entry durable, nor bytes other than those checked
                data = self.store.read_verified(entry, source.checksum_algo)
                sink = writer.open_blob(entry.blob)
                sink.write(data)
                sink.close()
                nbytes += len(data)
            writer.commit(build_manifest(iteration, source.checksum_algo, entries, meta)[0])
        except BaseException:
            writer.abort()
            raise
        return nbytes


def _holds(held: PointRecord, source: PointRecord, entries: list[EntryRecord]) -> bool:
    """Whether the durable point ``held`` already has every one of ``entries`` of ``source`` byte for byte:
    the same checksums (the manifests hold them; nothing is read)."""
    if held.checksum_algo != source.checksum_algo:
        return False
    checksums = {(e.op, e.level): e.checksum for e in held.all_entries()}
    return all(checksums.get((e.op, e.level)) == e.checksum for e in entries)
