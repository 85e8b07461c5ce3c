"""Background receiver: one thread per source rank (``ReplicaPlan.sources``) takes points off the
transport, verifies every entry against the owner's checksums, and publishes the verified ones into this
node's store of the owner's replicas, ``<root>/<job>/replicas/rank<owner>`` (same format as a rank's own
store, so ``moe-ft inspect`` and :class:`SnapshotStore` read it). A mismatching entry is rejected, never
published, and reported (``rejections``, logger ``moe_ft.replication``); the rest of the point is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from moe_ft.replication.transport import PointMessage, Transport
from moe_ft.store import SnapshotStore, StoreConfig
from moe_ft.store.capacity import SNAPSHOT_POINTS
from moe_ft.store.codec import digest_view
from moe_ft.store.errors import CorruptEntryError
from moe_ft.store.manifest import EntryRecord, build_manifest, decode_manifest

logger = logging.getLogger("moe_ft.replication")


OWNER_MANIFEST = "OWNER_MANIFEST.json"
"""Blob of a replica point: the owner's own manifest, byte for byte (it lists entries deduplicated away
by MoEtion §5.1 too; a rebuilt node-local point is published under it, ``fetch.py``)."""


def replica_store_config(*, root: str, job_id: str, owner: int, holder: int | None = None) -> StoreConfig:
    """Where this node keeps rank ``owner``'s replicas. ``holder``: the holding rank, for nodes simulated in
    one store root (``--ft-ranks-per-node``), where two holders of one owner would otherwise share (and both
    write) one directory."""
    return StoreConfig(root=root, job_id=f"{job_id}/replicas" + ("" if holder is None else f"/holder{holder}"),
                       rank=owner)


@dataclass(kw_only=True)
class ReceiverConfig:
    keep_points: int = 8
    """Newest replicated points kept per owner (older ones are deleted after each arrival); at least one
    sparse window plus the one in flight."""
    keep: Callable[[], int] | None = None
    """When set, read at each arrival instead of :attr:`keep_points` (:func:`points_to_keep` of the job's
    policy, whose sparse window is known from its first plan on)."""

    def __post_init__(self) -> None:
        if self.keep_points < 1:
            raise ValueError(f"keep_points must be >= 1, got {self.keep_points}")


@dataclass(frozen=True)
class Rejection:
    owner: int
    iteration: int
    entry: str
    reason: str


def verify_message(message: PointMessage) -> tuple[str, list[EntryRecord], EntryRecord | None, list[Rejection]]:
    """Check ``message`` against the owner's manifest: returns (checksum algorithm, verified operator
    entries, verified metadata entry, rejections). A damaged manifest rejects the whole point."""
    it, owner = message.iteration, message.owner
    try:
        record = decode_manifest(message.manifest, it, f"replica of rank {owner} iteration {it}")
    except CorruptEntryError as exc:
        return "", [], None, [Rejection(owner, it, "MANIFEST", exc.reason)]
    by_blob = {e.blob: e for e in record.all_entries()}
    good, meta, rejected = [], None, []
    for name, data in message.blobs.items():
        entry = by_blob.get(name)
        if entry is None:
            rejected.append(Rejection(owner, it, name, "not in the owner's manifest"))
            continue
        try:
            if len(data) != entry.nbytes:
                raise CorruptEntryError(name, f"{len(data)} bytes arrived, manifest says {entry.nbytes}")
            # the checks of read_entry (magic, header, trailer, digest, key) over the bytes as they arrived:
            # no copy of the blob (the node agent's blobs are views of its one receive buffer)
            digest_view(memoryview(data), checksum=entry.checksum, algo=record.checksum_algo, key=entry.key,
                        where=f"replica of rank {owner} iteration {it} {name}")
        except CorruptEntryError as exc:
            rejected.append(Rejection(owner, it, entry.name, exc.reason))
            continue
        if entry.op is None:
            meta = entry
        else:
            good.append(entry)
    return record.checksum_algo, good, meta, rejected


class ReplicaReceiver:
    """Receives the replicas of ``sources`` over ``transport`` into ``store_for(owner)``."""

    def __init__(self, config: ReceiverConfig, transport: Transport, sources: Sequence[int],
                 store_for: Callable[[int], SnapshotStore]) -> None:
        self.config, self.transport, self.sources = config, transport, tuple(sources)
        self._stores = {src: store_for(src) for src in self.sources}
        self.received: list[tuple[int, int, int]] = []  # (owner, iteration, bytes)
        self.rejections: list[Rejection] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(src,), name=f"moe-ft-replica-recv{src}",
                                          daemon=True) for src in self.sources]
        for thread in self._threads:
            thread.start()

    def store(self, owner: int) -> SnapshotStore:
        return self._stores[owner]

    def join(self, timeout: float | None = None) -> None:
        """Wait until every source closed its stream; raises if a receiving thread failed."""
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name}: the source has not closed its replication stream")
        if self.errors:
            raise RuntimeError(f"replica receiver failed: {self.errors[0]!r}") from self.errors[0]

    def release(self, timeout: float) -> list[int]:
        """A failed attempt (in-process recovery keeps this process): give up the replica stores of the sources
        whose streams have ended (waiting up to ``timeout`` s in all for them to end; a stream of the failed
        attempt's group ends with an error when its peer's connection closes), so that the rank the next
        attempt's placement gives a source, in another process on this node, can write its store. A store
        whose stream still runs is kept (its thread may still write there). Returns the sources released."""
        deadline = time.monotonic() + timeout
        released = []
        for src, thread in zip(self.sources, self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            release = getattr(self._stores[src].backend, "release_writer", None)
            if not thread.is_alive() and release is not None and release():
                released.append(src)
        return released

    def _run(self, src: int) -> None:
        try:
            while (message := self.transport.receive(src)) is not None:
                if message.owner != src:
                    raise RuntimeError(f"rank {src} sent a point of rank {message.owner}; placement mismatch")
                self._accept(self._stores[src], message)
        except BaseException as exc:
            with self._lock:
                self.errors.append(exc)
            logger.error("moe-ft replica receiver (from rank %d): %r", src, exc)

    def _accept(self, store: SnapshotStore, message: PointMessage) -> None:
        keep = self.config.keep() if self.config.keep is not None else self.config.keep_points
        published, rejected = publish_replica(store, message, keep_points=keep)
        with self._lock:
            self.rejections.extend(rejected)
            if published:
                self.received.append((message.owner, message.iteration, message.nbytes))


def _write_blob(writer, name: str, data: bytes | memoryview) -> None:
    sink = writer.open_blob(name)
    sink.expect(len(data))  # announced: the arena writes it straight into its region instead of gathering it
    sink.write(data)
    sink.close()


def points_to_keep(policy, least: int = 8) -> int:
    """Newest replicated points a holder keeps of an owner running ``policy``: as many as the owner's node-local
    store holds at the least under its retention (``SnapshotPolicy.retained_points``), so that the replicas hold
    a complete recovery point as often as the owner's store does; ``least`` at the least. A fixed count of 8 held
    no complete sparse window of 6 points in 9 iterations of 24. ``selective``'s count is its even-routing need
    (``SelectivePolicy.retained_plans``), a lower bound."""
    return max(least, policy.retained_points() if policy is not None else SNAPSHOT_POINTS)


def publish_replica(store: SnapshotStore, message: PointMessage, *, keep_points: int) -> tuple[bool, list[Rejection]]:
    """Verify ``message`` (:func:`verify_message`) and publish its verified entries into ``store`` (the
    owner's replicas on this node), then keep the newest ``keep_points`` points; returns (published, the
    entries rejected, each logged). A damaged manifest publishes nothing. Used by the trainer's receiver and
    by the node agent (``moe_ft/agent/replicas.py``)."""
    algo, entries, meta, rejected = verify_message(message)
    for rejection in rejected:
        logger.warning("moe-ft replica of rank %d iteration %d: rejected %s: %s", rejection.owner,
                       rejection.iteration, rejection.entry, rejection.reason)
    if not algo:
        return False, rejected
    it, backend = message.iteration, store.backend
    if it in backend.list_points():  # re-snapshotted after a rollback: the newer bytes win
        store.delete_point(it)
    writer = backend.begin_point(it)
    try:
        for entry in entries + ([meta] if meta else []):
            _write_blob(writer, entry.blob, message.blobs[entry.blob])
        _write_blob(writer, OWNER_MANIFEST, message.manifest)  # every entry the owner had: what a rebuild restores
        writer.commit(build_manifest(it, algo, entries, meta)[0])  # the owner's per-entry checksums
    except BaseException:
        writer.abort()
        raise
    for old in backend.list_points()[:-keep_points]:
        store.delete_point(old)
    return True, rejected
