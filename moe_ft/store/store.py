"""The snapshot store: writes recovery points (one per iteration) into a :class:`StoreBackend`, reads them
back verified, answers recovery's queries and garbage-collects by a :class:`RetentionPolicy`.

Writer side (the snapshot engine's background thread)::
    with store.begin(iteration) as point:          # invisible until publish()
        point.put(OperatorId.expert_op(3, 7), Level.FULL, {"weight": w, "master.weight": m, ...})
        point.put_meta({"grad_norm": 1.25, "loss_scale": 65536.0}, {"rng.cpu": rng})
        point.publish()                            # atomic; then garbage collection

Reader side (recovery, ``moe-ft inspect``)::
    rp = store.newest_recoverable(SparseWindowRule.aligned(ops, window_size=4), verify=True)
    tensors = store.load(it, op, Level.FULL)       # raises CorruptEntryError, never returns bad bytes
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mmap
import os
import threading
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import entry_hash
from moe_ft.store.backend import MANIFEST, FaultHook, StagingInfo, StoreBackend
from moe_ft.store.catalog import Catalog, Problem
from moe_ft.store.codec import (
    DEFAULT_CHECKSUM,
    DTYPES,
    PENDING,
    WIDE_ITERATION,
    EntryLayout,
    WrittenEntry,
    check_tensor,
    digest_view,
    encode_meta,
    entry_digest,
    entry_head,
    layout_entry,
    new_checksum,
    read_entry,
    seal_entry,
    sealed_head,
    tensor_specs,
    write_entry,
)
from moe_ft.store.errors import CorruptEntryError, MissingEntryError, StoreError
from moe_ft.store.handoff import EntryKind, MetaOrder, PublishOrder, handed_over_anyway, manifest_room
from moe_ft.store.layouts import open_backend
from moe_ft.store.manifest import (
    META_BLOB,
    EntryRecord,
    PointRecord,
    TensorRecord,
    build_manifest,
    decode_manifest,
    entry_blob,
    entry_json_bound,
    entry_key,
    entry_record,
    manifest_bound,
    seal_from_sums,
    table_records,
)
from moe_ft.store.retention import RetentionPolicy
from moe_ft.store.rules import EntryRef, RecoveryPoint, RecoveryRule, newest_recoverable

logger = logging.getLogger("moe_ft.store")


class Publisher(Protocol):
    """Publishes a store's points in another process (:attr:`SnapshotStore.publisher`)."""

    rank: int

    def publish(self, order: PublishOrder, kinds: list[tuple[EntryKind, EntryLayout]],
                retention: RetentionPolicy | None) -> dict[str, Any]:
        """Send ``order`` (with those of its entries' ``kinds`` and layouts and ``retention`` the other side
        lacks); returns its answer (``{"written", "deleted"}``) once the point is published."""


@dataclass(kw_only=True)
class StoreConfig:
    """Node-local store of one rank: ``<root>/<job_id>/rank<rank>``."""

    root: str = "/dev/shm/moe_ft"
    """Parent directory; a tmpfs so that snapshots outlive the worker process."""
    job_id: str = "default"
    """Job name; separates concurrent jobs on one node."""
    rank: int = 0
    """Global rank owning the directory (one writing process per directory)."""
    fsync: bool = False
    """fsync files and directories around publish. Only useful when ``root`` is a disk; tmpfs needs none."""
    recycle: bool = False
    """Write new entries over the files of deleted points of the same size (tmpfs pages overwritten
    instead of freed and allocated again; ``docs/store.md`` "Recycled entry files")."""
    layout: str = "arena"
    """``arena`` (regions of preallocated files, one index file per point: ``moe_ft/store/arena.py``) or
    ``files`` (a directory of files per point). An existing store is opened as what it is."""
    initial_bytes: int = 0
    """Arena layout: size of its first segment (0: grown as needed)."""
    checksum: str = DEFAULT_CHECKSUM
    """Entry checksum: ``xxh3_64`` (default: fastest, 64-bit), ``crc32`` (the former default, zlib) or
    ``blake2b``. Points written with any of them stay readable (the manifest names the algorithm)."""
    checksum_by: str = "writer"
    """``writer``: the writing process hashes each operator entry as it writes it; ``agent``: it writes
    each byte once and the node agent hashes the published point (:meth:`SnapshotStore.record_verified`)."""

    @property
    def directory(self) -> Path:
        return Path(self.root) / self.job_id / f"rank{self.rank}"

    def build(self, retention: RetentionPolicy | None = None, fault_hook: FaultHook | None = None) -> "SnapshotStore":
        backend = open_backend(self.directory, layout=self.layout, fsync=self.fsync, fault_hook=fault_hook,
                               recycle=self.recycle, initial_bytes=self.initial_bytes)
        if self.checksum_by not in ("writer", "agent"):
            raise ValueError(f"checksum_by must be 'writer' or 'agent', got {self.checksum_by!r}")
        return SnapshotStore(backend, checksum=self.checksum, retention=retention,
                             defer_checksums=self.checksum_by == "agent")


@dataclass(frozen=True)
class MetaEntry:
    """Per-iteration scalars for exact replay (grad norm, loss scale, LR position, consumed samples …)
    and tensors (RNG states, popularity counters)."""

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _check_bytes(data: bytes, entry: EntryRecord, algo: str, where: str, what: str) -> None:
    """Raise :class:`CorruptEntryError` unless ``data`` is ``entry``'s bytes (size, checksum, key)."""
    if len(data) != entry.nbytes:
        raise CorruptEntryError(where, f"{len(data)} bytes {what}, manifest says {entry.nbytes}")
    read_entry(io.BytesIO(data), size=entry.nbytes, checksum=entry.checksum, algo=algo, key=entry.key, where=where)


class _SegmentMaps:
    """Read-only mappings of arena segments, kept from one point to the next: a process that hashes point
    after point (the node agent, ``record_verified``) maps each segment once, and its pages are faulted in
    once, instead of mapping and populating every entry's region again (50 MB of entries on the 2-core
    machine: 8.9 ms of CPU per point mapped per entry, see docs/store.md). A mapping is dropped when its
    path names another file (a store created again) or no file; each new mapping first drops those of
    segments that are gone (a deleted store's pages are freed once its views are released). Segments are
    never truncated while their store exists (``moe_ft/store/arena.py``)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}
        self._lock = threading.Lock()

    def view(self, path: str, start: int, length: int) -> memoryview:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            found = self._maps.get(path)
            if found is None or found[0] != key or len(found[1]) < start + length:
                self._prune()
                with open(path, "rb") as f:
                    found = self._maps[path] = (key, mmap.mmap(f.fileno(), st.st_size, flags=mmap.MAP_SHARED,
                                                               prot=mmap.PROT_READ))
            # a dropped mapping is unmapped when its last view is released (never under a reader)
            return memoryview(found[1])[start:start + length]

    def _prune(self) -> None:
        for path, (key, _) in list(self._maps.items()):
            try:
                st = os.stat(path)
                gone = (st.st_dev, st.st_ino) != key
            except FileNotFoundError:
                gone = True
            if gone:
                del self._maps[path]


_SEGMENTS = _SegmentMaps()


@contextlib.contextmanager
def _mapped(backend: StoreBackend, iteration: int, blob: str) -> Iterator[memoryview | None]:
    """A read-only view of a published blob's bytes where the backend keeps them (a file region, mapped),
    or ``None`` (a backend without files)."""
    try:
        path, start, length = backend.blob_location(iteration, blob)
    except NotImplementedError:
        yield None
        return
    if length == 0:
        yield memoryview(b"")
        return
    if backend.maps_regions:  # an arena segment: its mapping is kept for the next points
        view = _SEGMENTS.view(path, start, length)
        try:
            yield view
        finally:
            view.release()
        return
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        # MAP_POPULATE (Linux): the kernel maps the region's pages in one pass, not a fault per page (64 MB of
        # tmpfs: 6.4 ms of CPU to map and hash instead of 10.2 ms, measured here)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(f.fileno(), length + start - aligned, flags=flags, prot=mmap.PROT_READ, offset=aligned)
        view = memoryview(region)[start - aligned:]
        try:
            yield view
        finally:
            view.release()
            region.close()


def _discard(buf) -> None:
    """A sink that keeps nothing (``put_remote`` hashes an entry without storing it)."""


class ReservedEntry:
    """An operator's entry laid out in a mapped store region (:meth:`PendingPoint.reserve`): copy the
    tensors' bytes into their places (:meth:`byte_views`, or the typed :attr:`views`; a device-to-host copy
    lands there directly), then :meth:`seal`."""

    def __init__(self, point: "PendingPoint", op: OperatorId, level: Level, blob: str, layout: EntryLayout,
                 mapped: tuple[torch.Tensor, int, int]) -> None:
        self._point, self.op, self.level, self.blob = point, op, level, blob
        self.layout, self._mapped = layout, mapped  # (its segment's bytes, offset, size): PointWriter.map_blobs
        self._view: torch.Tensor | None = None

    @property
    def _region(self) -> torch.Tensor:
        """The region's bytes, a flat ``uint8`` tensor (made when first asked for: a copy by address needs none)."""
        if self._view is None:
            mapping, offset, size = self._mapped
            self._view = mapping[offset:offset + size]
        return self._view

    @property
    def address(self) -> int:
        """The host address of the region's first byte (the entry's; tensor ``i`` is at
        ``layout.table[i]["offset"]`` from it)."""
        mapping, offset, _ = self._mapped
        return mapping.data_ptr() + offset

    def byte_views(self) -> list[torch.Tensor]:
        """Each tensor's bytes in the region, as flat ``uint8`` tensors (one split for all of them)."""
        if not self.layout.table:
            return []
        return list(self._region[:self.layout.body].split_with_sizes(self.layout.splits)[1::2])

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """Name -> a tensor of the entry's dtype and shape over its bytes in the region."""
        return {rec["name"]: b.view(DTYPES[rec["dtype"]]).view(rec["shape"])
                for rec, b in zip(self.layout.table, self.byte_views())}

    @property
    def first_words(self) -> list[int]:
        return self.layout.first_words

    def seal(self, tensor_sums: list[list[int]] | None = None) -> EntryRecord:
        """The tensors' bytes are final: write the entry's header, padding and digest around them.
        ``tensor_sums``: each tensor's ``mfh64`` lane sums, computed on the device from the bytes that were
        copied (the host then reads no payload byte); ``None``: hash the region on the host."""
        point = self._point
        algo = point._store.checksum
        # the region is a flat uint8 tensor: its bytes without raw_bytes's reshape and view
        region = memoryview(self._region.numpy()).cast("B")  # type: ignore[arg-type]  # see raw_bytes
        if tensor_sums is None:  # the region is hashed whole on the host
            head = entry_head(self.layout, entry_key(point.iteration, self.op, self.level), algo)
            written = seal_entry(region, self.layout, head, algo)
        else:
            written = seal_from_sums(region, self.layout, point.iteration, self.op, self.level, algo, tensor_sums)
        point._writer.mapped_done(self.blob)
        record = EntryRecord(point.iteration, self.op, self.level, self.blob, written.nbytes, written.checksum,
                             point._store._tensor_records(self.layout))
        with point._lock:
            point.touched += written.hashed if tensor_sums is None else 0
            point._entries[self.op] = record
        return record

    def hand_off(self, tensor_sums: list[list[int]]) -> None:
        """The tensors' bytes are final: leave the header, padding and digest to the process that publishes the
        point (:attr:`SnapshotStore.publisher`, the node agent), with the tensors' ``mfh64`` lane sums."""
        point = self._point
        point._writer.mapped_done(self.blob)
        kind = point._store._entry_kind(self.op, self.level, self.blob, self.layout)
        with point._lock:
            point._unsealed.append((kind, self.layout, tensor_sums))

    def finish(self, tensor_sums: list[list[int]]) -> EntryRecord | None:
        """:meth:`hand_off` when the store's points are published by another process, else :meth:`seal`
        (returns the entry's record then)."""
        if self._point._store.publisher is not None:
            self.hand_off(tensor_sums)
            return None
        return self.seal(tensor_sums)


class PendingPoint:
    """A point being written. ``put``/``put_meta`` may be called from several threads at once (one entry
    each); tensors are written straight from their memory (e.g. pinned host buffers) and may be reused as
    soon as ``put`` returns. Leaving the ``with`` block without :meth:`publish` aborts the point."""

    def __init__(self, store: "SnapshotStore", iteration: int) -> None:
        self.iteration = iteration
        self._store = store
        self._writer = store.backend.begin_point(iteration)
        self._lock = threading.Lock()
        self._entries: dict[OperatorId, EntryRecord] = {}
        self._meta: EntryRecord | None = None
        self._remote: dict[OperatorId, EntryRecord] = {}
        self._unsealed: list[tuple[EntryKind, EntryLayout, list[list[int]]]] = []  # sealed by the publisher (hand_off)
        self._meta_order: MetaOrder | None = None  # the metadata entry, for the publisher to write
        self._reserved: set[str] = set()
        self._state = "open"
        self.touched = 0
        """Payload bytes this process's threads passed over for the operators' entries: hashed, plus written
        into the store (a put hashes and writes each byte: 2 passes; a remote entry is only hashed)."""

    def _reserve(self, *names: str) -> None:
        with self._lock:
            if self._state != "open":
                raise RuntimeError(f"point {self.iteration} is {self._state}; cannot add {', '.join(names) or 'entries'}")
            for what in names:
                if what in self._reserved:
                    raise ValueError(f"point {self.iteration} already holds {what} (a plan gives each operator "
                                     f"one level per iteration)")
                self._reserved.add(what)

    def _write(self, blob: str, key: dict, tensors: Mapping[str, torch.Tensor], meta_json=None, *, count=True):
        sink = self._writer.open_blob(blob)
        try:  # operator entries may leave their digest to the node agent; the (small) metadata is hashed here
            written = write_entry(sink.write, key, tensors, self._store.checksum, meta_json=meta_json,
                                  expect=sink.expect, defer=count and self._store.defer_checksums)
        finally:
            sink.close()
        if count:
            with self._lock:
                self.touched += written.hashed + written.nbytes
        return written

    def put(self, op: OperatorId, level: Level, tensors: Mapping[str, torch.Tensor], specs=None) -> EntryRecord | None:
        """Write the entry (iteration, ``op``, ``level``): named contiguous CPU tensors of any dtype. Returns its
        record; ``None`` when the process that publishes the point seals it (:attr:`SnapshotStore.publisher`).
        ``specs``: the tensors' :func:`~moe_ft.store.codec.tensor_specs`, if the caller keeps them (the snapshot
        engine writes the same tensors at every snapshot)."""
        if not isinstance(op, OperatorId):
            raise TypeError(f"op must be an OperatorId, got {type(op).__name__}")
        level = Level(level)
        if level == Level.NONE:
            raise ValueError(f"{op}: level NONE saves nothing; leave the operator out instead")
        if self._store.copies_hashing:
            return self._copy_hashing(op, level, tensors, specs)
        self._reserve(str(op))
        blob = entry_blob(op, level)
        record = entry_record(self.iteration, op, level, blob,
                              self._write(blob, entry_key(self.iteration, op, level), tensors))
        with self._lock:
            self._entries[op] = record
        return record

    def _copy_hashing(self, op: OperatorId, level: Level, tensors: Mapping[str, torch.Tensor],
                      specs=None) -> EntryRecord | None:
        """:meth:`put` in one pass over the payload (:attr:`SnapshotStore.copies_hashing`): the entry is laid out
        in a region of the arena, each tensor is copied into its place by a copy that sums its words as it reads
        them (:func:`~moe_ft.store.entry_hash.copy_lane_sums`), and the entry is sealed from those sums. The
        bytes are those :func:`~moe_ft.store.codec.write_entry` writes; the digest covers what was read from
        the tensors, so a byte changed in the region after the copy is found by every reader."""
        checked = {name: check_tensor(name, t) for name, t in tensors.items()}
        entry = self.reserve(op, level, checked, specs)
        sums = [entry_hash.copy_lane_sums(t, view, first)
                for t, view, first in zip(checked.values(), entry.byte_views(), entry.first_words)]
        record = entry.finish(sums)
        with self._lock:
            self.touched += sum(rec["nbytes"] for rec in entry.layout.table)
        return record

    def layout(self, op: OperatorId, level: Level, specs) -> EntryLayout:
        """The layout of ``op``'s entry at ``level`` in this point, from :func:`~moe_ft.store.codec.tensor_specs`
        of its tensors: the one ``write_entry`` gives, cached by blob and specs (headers are laid out for a
        12-digit iteration, :data:`~moe_ft.store.codec.WIDE_ITERATION`; a longer one is laid out anew)."""
        blob = entry_blob(op, level)
        cache_key = (blob, self.iteration > WIDE_ITERATION and len(str(self.iteration)), specs)
        layout = self._store._layouts.get(cache_key)
        if layout is None:
            layout = layout_entry(entry_key(self.iteration, op, level), specs, self._store.checksum)
            self._store._layouts[cache_key] = layout
        return layout

    def reserve(self, op: OperatorId, level: Level, like: Mapping[str, torch.Tensor], specs=None) -> ReservedEntry:
        """Lay out the entry (iteration, ``op``, ``level``) of tensors shaped and typed like ``like`` (any
        device; ``specs``: their :func:`~moe_ft.store.codec.tensor_specs`, if the caller keeps them) in a
        region of the store's own memory, for a copy in place; needs a backend that maps regions
        (``maps_regions``: the arena)."""
        return self.reserve_all([(op, level, like, specs)])[0]

    def reserve_all(self, requests: Iterable[tuple[OperatorId, Level, Mapping[str, torch.Tensor] | None, Any]]
                    ) -> list[ReservedEntry]:
        """:meth:`reserve` of several entries, ``(op, level, like, specs)`` each (``like`` may be ``None`` when
        ``specs`` is given): their names and regions taken at once (a snapshot's entries, reserved on the
        training thread)."""
        if not self._store.backend.maps_regions:
            raise ValueError(f"{self._store.backend.describe()}: this store layout cannot map regions "
                             "(use the arena layout, or put())")
        laid = []
        for op, level, like, specs in requests:
            if not isinstance(op, OperatorId):
                raise TypeError(f"op must be an OperatorId, got {type(op).__name__}")
            level = Level(level)
            if level == Level.NONE:
                raise ValueError(f"{op}: level NONE saves nothing; leave the operator out instead")
            if specs is None:
                if like is None:
                    raise ValueError(f"{op}: reserve needs the tensors (like) or their specs")
                specs = tensor_specs(like)
            laid.append((op, level, entry_blob(op, level), self.layout(op, level, specs)))
        self._reserve(*(str(op) for op, *_ in laid))
        mapped = self._writer.map_blobs([(blob, layout.size) for _, _, blob, layout in laid])
        return [ReservedEntry(self, op, level, blob, layout, m) for (op, level, blob, layout), m in zip(laid, mapped)]

    def put_remote(self, op: OperatorId, tensors: Mapping[str, torch.Tensor],
                   tensor_sums: list[list[int]] | None = None, layout: EntryLayout | None = None) -> EntryRecord:
        """Record ``op``'s FULL entry without writing it: its size and checksum (the bytes are hashed, not
        stored), listed in the manifest as held by the replica peers (:attr:`EntryRecord.remote`), which
        rebuild it from the step's gradients (MoEtion §5.2). Goes with a :meth:`put` of the operator's
        COMPUTE entry (the owner's own copy of the compute weights). ``tensor_sums``: the tensors' mfh64
        lane sums computed on their device, keyed by their offsets in ``layout`` (:meth:`layout` of the FULL
        entry: the layout ``write_entry`` gives, which the peers' rebuilt entry has too)."""
        if not isinstance(op, OperatorId):
            raise TypeError(f"op must be an OperatorId, got {type(op).__name__}")
        self._reserve(f"remote {op}")
        blob = entry_blob(op, Level.FULL)
        key = entry_key(self.iteration, op, Level.FULL)
        if tensor_sums is None:
            written = write_entry(_discard, key, tensors, self._store.checksum)
            payload = written.hashed
        else:  # the tensors' mfh64 lane sums, computed on their device (keyed by their offsets in ``layout``)
            if self._store.checksum != entry_hash.ALGO:
                raise ValueError(f"tensor digests computed on the device are {entry_hash.ALGO}, the store uses "
                                 f"{self._store.checksum}")
            laid = layout if layout is not None else self.layout(op, Level.FULL, tensor_specs(tensors))
            head, head_sums = sealed_head(laid, key, self._store.checksum)
            digest, _ = entry_digest(laid, head, tensor_sums, head_sums)
            written, payload = WrittenEntry(laid.size, digest.hex(), laid.table), 0
        record = replace(entry_record(self.iteration, op, Level.FULL, blob, written), remote=True)
        with self._lock:
            self._remote[op] = record
            self.touched += payload
        return record

    def put_meta(self, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> EntryRecord | None:
        """Write the iteration's metadata entry: a JSON-able dict (floats round-trip exactly) + tensors. With a
        :attr:`SnapshotStore.publisher` the dict is pickled and the tensors' bytes copied, and the publishing
        process encodes and writes the entry (a dict that is not JSON-able then fails the publish): ``None``."""
        if self._store.publisher is not None:
            order = MetaOrder.of(meta, tensors or {})
            self._reserve("meta")
            self._meta_order = order
            return None
        try:
            meta_json = encode_meta(meta)  # encoded once, here: validates, and the header embeds it as is
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata of iteration {self.iteration} is not JSON-serialisable: {exc}") from None
        self._reserve("meta")
        record = entry_record(self.iteration, None, None, META_BLOB,
                              self._write(META_BLOB, entry_key(self.iteration, None, None), tensors or {}, meta_json,
                                          count=False))
        with self._lock:
            self._meta = record
        return record

    def publish(self) -> PointRecord | None:
        """Make the point visible atomically, then run garbage collection. With a :attr:`SnapshotStore.publisher`
        (the node agent) that process seals the handed-off entries, publishes and collects: returns ``None``."""
        with self._lock:
            if self._state != "open":
                raise RuntimeError(f"point {self.iteration} is {self._state}")
            self._state = "publishing"
        if self._store.publisher is not None:
            self._hand_over(self._store.publisher)
            return None
        try:
            manifest, record = build_manifest(self.iteration, self._store.checksum, list(self._entries.values()),
                                              self._meta, list(self._remote.values()))
            self._writer.commit(manifest)
        except BaseException:
            self.abort()
            raise
        self._state = "published"
        self._store._remember(self.iteration, manifest, record)
        self._store._after_publish(self.iteration)
        return record

    def _hand_over(self, publisher: "Publisher") -> None:
        """:meth:`publish` by ``publisher`` (``moe_ft/store/handoff.py``). When it fails, the point is published
        if its index names this point's regions (the publisher died after the link), else aborted."""
        store, writer = self._store, self._writer
        algo = store.checksum
        meta = self._meta if self._meta_order is None else self._meta_order.record(self.iteration)
        bound = manifest_bound(
            self.iteration, algo,
            [store._entry_json_bound(kind, layout) for kind, layout, _ in self._unsealed]
            + [entry_json_bound(e, algo) for e in self._entries.values()],
            None if meta is None else entry_json_bound(meta, algo),
            [entry_json_bound(e, algo) for e in self._remote.values()])
        rooms = {MANIFEST: manifest_room(bound)}
        if self._meta_order is not None:
            rooms[META_BLOB] = self._meta_order.room()
        try:
            blobs, regions = writer.hand_over(rooms)
        except BaseException:
            self.abort()
            raise
        order = PublishOrder(
            rank=publisher.rank, store_dir=store.backend.describe(), iteration=self.iteration, checksum=store.checksum,
            writer_pid=os.getpid(),
            unsealed=[(id(kind), sums) for kind, _, sums in self._unsealed],
            sealed=list(self._entries.values()), meta=self._meta, remote=list(self._remote.values()), blobs=blobs,
            manifest_region=regions[MANIFEST], meta_order=self._meta_order, meta_region=regions.get(META_BLOB),
            fsync=getattr(store.backend, "fsync", False), marker=writer.order_marker())
        hook = getattr(store.backend, "_hook", None)
        try:
            if hook is not None:
                hook("before_commit", self.iteration, "")  # everything copied, nothing published (drills)
            written = publisher.publish(order, [(kind, layout) for kind, layout, _ in self._unsealed],
                                        store.retention)["written"]
        except BaseException:
            found = handed_over_anyway(store.backend, self.iteration, blobs, regions)
            if found is None:
                # the order taken back, so that no agent writes its regions once they are freed; the agent may
                # have linked the point before it let go of the order (``moe_ft/store/order_claim.py``)
                holder = writer.withdraw()
                found = handed_over_anyway(store.backend, self.iteration, blobs, regions)
            if found is None:
                if isinstance(holder, int):  # a live agent still holds it: its regions stay allocated
                    writer.doubt()
                    self._state = "aborted"
                else:
                    self.abort()
                raise
            written = found
        writer.handed_over(written)
        self._state = "published"
        if hook is not None:
            hook("after_commit", self.iteration, "")
        store._after_publish(self.iteration, collected=True)

    def abort(self) -> None:
        if self._state != "published":
            self._state = "aborted"
            self._writer.abort()

    def __enter__(self) -> "PendingPoint":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class SnapshotStore:
    def __init__(self, backend: StoreBackend, *, checksum: str = DEFAULT_CHECKSUM,
                 retention: RetentionPolicy | None = None, shared_pins: bool = False,
                 defer_checksums: bool = False) -> None:
        new_checksum(checksum)  # validates the name
        self.backend = backend
        self.defer_checksums = defer_checksums
        """Operator entries are written with their digest deferred (:data:`~moe_ft.store.codec.PENDING`): the
        node agent hashes each published point and records the digests beside it (:meth:`record_verified`)."""
        directory = getattr(backend, "directory", None)
        self._verified_dir = None if directory is None else Path(directory) / "verified"
        self._unverified_warned: set[int] = set()
        self.shared_pins = shared_pins
        """:meth:`pin` also pins for the writing process (this object reads another process's store)."""
        self.publisher: Publisher | None = None
        """Seals the handed-off entries, publishes each point and collects garbage in another process (the node
        agent: ``--ft-publish-by agent``, ``moe_ft/store/handoff.py``); ``None``: this process does."""
        self._json_bounds: dict[int, int] = {}  # id(EntryKind) -> its record's manifest JSON at most (kinds are kept)
        self.on_publish: list[Callable[[int], None]] = []
        """Called with the iteration after each publish and its garbage collection, on the publishing thread
        (the node agent's durable copies are requested from here: no wait for the next iteration)."""
        self.checksum = checksum
        self.copies_hashing = (checksum == entry_hash.ALGO and entry_hash.NATIVE and not defer_checksums
                               and backend.maps_regions)
        """:meth:`PendingPoint.put` copies each tensor into a region of the arena and hashes it in the same pass
        (``mfh64`` with its C build): one host pass over the payload, the writer's digest kept."""
        self.retention = retention
        self._lock = threading.Lock()
        self._pins: Counter[int] = Counter()
        # Manifests this store published, as written and as decoded: decoding (JSON, checksum, records)
        # is most of garbage collection's cost, and GC runs after every publish. A cached record is used
        # only while the manifest on storage is still byte-for-byte what was written (see _decode).
        self._written: dict[int, tuple[bytes, PointRecord]] = {}
        self._layouts: dict[tuple, EntryLayout] = {}  # entries laid out for copies in place, by blob and shapes
        self._records_by_layout: dict[int, tuple[EntryLayout, tuple[TensorRecord, ...]]] = {}
        self._kinds: dict[tuple[str, int], EntryKind] = {}  # by blob and layout id (layouts are never dropped)

    def __repr__(self) -> str:
        return f"SnapshotStore({self.backend.describe()})"

    # -- writing ---------------------------------------------------------------------------------------
    def begin(self, iteration: int) -> PendingPoint:
        """Start point ``iteration``. Re-snapshotting a published iteration (e.g. during replay) needs an
        explicit :meth:`discard_after` or :meth:`delete_point` first."""
        if self.backend.has_point(iteration):
            raise ValueError(f"point {iteration} is already published in {self.backend.describe()}; "
                             f"call discard_after({iteration - 1}) after a rollback before re-snapshotting it")
        return PendingPoint(self, iteration)

    def _tensor_records(self, layout: EntryLayout) -> tuple[TensorRecord, ...]:
        """The tensor records of an entry of ``layout`` (what :func:`_records` makes of its table), made once
        per layout (layouts are immutable; the layout is kept with them, so its id is not reused)."""
        known = self._records_by_layout.get(id(layout))
        if known is None:
            known = self._records_by_layout[id(layout)] = (layout, table_records(layout.table))
        return known[1]

    def _entry_json_bound(self, kind: EntryKind, layout: EntryLayout) -> int:
        """:func:`~moe_ft.store.manifest.entry_json_bound` of an entry of ``kind``, made once per kind (a point
        handed over names hundreds of entries; their tensor tables do not change)."""
        known = self._json_bounds.get(id(kind))
        if known is None:
            record = EntryRecord(0, kind.op, kind.level, kind.blob, layout.size, PENDING, self._tensor_records(layout))
            known = self._json_bounds[id(kind)] = entry_json_bound(record, self.checksum)
        return known

    def _entry_kind(self, op: OperatorId, level: Level, blob: str, layout: EntryLayout) -> EntryKind:
        """What the publisher is told of an entry of ``layout`` once (:class:`~moe_ft.store.handoff.EntryKind`),
        made once per blob and layout (kept: its id names it in every order)."""
        key = (blob, id(layout))  # layouts are cached for the store's life: their ids are not reused
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = EntryKind(op, level, blob, id(layout))
        return kind

    def _remember(self, iteration: int, manifest: bytes, record: PointRecord) -> None:
        with self._lock:
            self._written[iteration] = (manifest, record)

    def _decode(self, iteration: int, data: bytes) -> PointRecord:
        """``decode_manifest`` of ``data``, skipped when ``data`` is exactly the manifest this store wrote
        for ``iteration`` (then decoding would give the remembered record: same bytes, same result); entries
        written with their digest deferred get the digests the node agent recorded, when it has."""
        with self._lock:
            written = self._written.get(iteration)
        if written is not None and written[0] == data:
            record = written[1]
        else:
            record = decode_manifest(data, iteration, self._where(iteration, MANIFEST))
        return self._resolved(iteration, data, record)

    # -- digests recorded after publish (the node agent) -------------------------------------------------
    @property
    def records_digests(self) -> bool:
        """Digests can be recorded beside this store's points (:meth:`record_verified`: a store on disk)."""
        return self._verified_dir is not None

    def _verified_path(self, iteration: int) -> Path | None:
        return None if self._verified_dir is None else self._verified_dir / f"{iteration}.json"

    def _resolved(self, iteration: int, manifest: bytes, record: PointRecord) -> PointRecord:
        """``record`` with the digests the node agent recorded for its :data:`PENDING` entries (those it has
        not hashed yet stay pending: readers check their structure only). A record written for another
        point of the same iteration (a timeline abandoned by a recovery) does not apply: it names the
        manifest it was made for."""
        if not any(e.checksum == PENDING for e in record.all_entries()):
            return record
        digests = self._recorded(iteration, manifest)
        if not digests:
            return record

        def fill(entry: EntryRecord) -> EntryRecord:
            return replace(entry, checksum=digests[entry.blob]) if entry.checksum == PENDING and entry.blob in digests \
                else entry

        meta = None if record.meta is None else fill(record.meta)
        return replace(record, entries={op: fill(e) for op, e in record.entries.items()}, meta=meta)

    def _recorded(self, iteration: int, manifest: bytes) -> dict[str, str]:
        """The digests recorded beside point ``iteration`` for exactly this ``manifest`` (``{}``: none)."""
        path = self._verified_path(iteration)
        try:
            recorded = json.loads(path.read_text()) if path is not None else {}
        except (FileNotFoundError, ValueError):
            return {}
        return recorded.get("digests", {}) if recorded.get("manifest") == hashlib.sha256(manifest).hexdigest() else {}

    def record_verified(self, iteration: int) -> dict[str, str]:
        """The node agent's side: hash every :data:`PENDING` entry of published point ``iteration`` (read
        once, its structure and key checked) and record the digests beside the point, atomically, for the
        manifest they were computed under. Returns ``{blob: digest}`` (empty when nothing was pending).
        Raises :class:`CorruptEntryError` for an entry that is already damaged (nothing is recorded then:
        the entry stays unverified and recovery finds it wrong by its structure or uses another point)."""
        path = self._verified_path(iteration)
        if path is None:
            raise ValueError(f"{self.backend.describe()}: digests are recorded beside points of a store on disk")
        with self.pin([iteration]):
            manifest = self.backend.read_blob(iteration, MANIFEST)
            record = decode_manifest(manifest, iteration, self._where(iteration, MANIFEST))
            pending = [e.blob for e in record.all_entries() if e.checksum == PENDING]
            recorded = self._recorded(iteration, manifest)
            if pending and set(pending) <= set(recorded):  # hashed already (a durable copy asked first)
                return {blob: recorded[blob] for blob in pending}
            digests = {}
            for entry in record.all_entries():
                if entry.checksum != PENDING:
                    continue
                where = self._where(iteration, entry.blob)
                with _mapped(self.backend, iteration, entry.blob) as view:
                    if view is not None and len(view) == entry.nbytes:  # hashed in place: no copy
                        digests[entry.blob] = digest_view(view, checksum=PENDING, algo=record.checksum_algo,
                                                          key=entry.key, where=where)
                        continue
                with self.backend.open_blob(iteration, entry.blob) as stream:
                    decoded = read_entry(stream, size=entry.nbytes, checksum=PENDING, algo=record.checksum_algo,
                                         key=entry.key, where=where)
                digests[entry.blob] = decoded.digest
        if digests:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"manifest": hashlib.sha256(manifest).hexdigest(), "digests": digests}))
            os.replace(tmp, path)
        return digests

    def manifest_with_digests(self, iteration: int, manifest: bytes) -> bytes:
        """``manifest`` (of published point ``iteration``) with the digest of every :data:`PENDING` entry filled
        in, hashing the point first where the node agent has not yet (:meth:`record_verified`): what a copy
        to another node carries, since its receiver verifies against the manifest alone. A manifest with
        nothing pending is returned as it is. Raises :class:`CorruptEntryError` for an entry already
        damaged, ``ValueError`` for a point with FULL entries held by replica peers only (optimizer
        recomputation, which does not defer digests)."""
        record = decode_manifest(manifest, iteration, self._where(iteration, MANIFEST))
        if not any(e.checksum == PENDING for e in record.all_entries()):
            return manifest
        self.record_verified(iteration)
        resolved = self._resolved(iteration, manifest, record)
        if any(e.checksum == PENDING for e in resolved.all_entries()):
            raise StoreError(f"{self._where(iteration, MANIFEST)}: digests recorded for another manifest")
        if resolved.shadowed or any(e.remote for e in resolved.entries.values()):
            raise ValueError(f"{self._where(iteration, MANIFEST)}: entries held by replica peers only")
        return build_manifest(iteration, resolved.checksum_algo, list(resolved.entries.values()), resolved.meta)[0]

    def _drop_verified(self, iterations: Iterable[int] | None = None) -> None:
        """Delete the recorded digests of ``iterations`` (``None``: of every point no longer listed)."""
        if self._verified_dir is None or not self._verified_dir.is_dir():
            return
        if iterations is None:
            listed = set(self.points())
            names = [n for n in os.listdir(self._verified_dir) if n.endswith(".json") and n[:-5].isdigit()
                     and int(n[:-5]) not in listed]
        else:
            names = [f"{it}.json" for it in iterations]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._verified_dir / name)

    def _after_publish(self, iteration: int, *, collected: bool = False) -> None:
        """Garbage collection (unless the publishing process ran it: ``collected``), then the listeners."""
        if self.retention is not None and not collected:
            self.gc()
        for listener in self.on_publish:
            listener(iteration)

    # -- listing ---------------------------------------------------------------------------------------
    def points(self) -> list[int]:
        """Published iterations, ascending (whatever their completeness)."""
        return self.backend.list_points()

    def staging(self) -> list[StagingInfo]:
        """Unpublished points: in flight, or torn by a writer that died (never readable)."""
        return self.backend.list_staging()

    def _where(self, iteration: int, blob: str) -> str:
        return f"{self.backend.describe()} iteration {iteration} {blob}"

    def catalog(self, iterations: Iterable[int] | None = None, *, report: bool = True) -> Catalog:
        """Read the manifests. A point whose manifest is damaged, or an entry whose file is missing or has
        the wrong size, is left out with a warning naming it (``Catalog.problems``; ``report=False``: no
        warning, for a listing that may race with the retention deleting a point, before it pins what it
        reads). Checksums of entry bytes are verified by :meth:`load` / :meth:`verify`, not here."""
        points: dict[int, PointRecord] = {}
        problems: list[Problem] = []
        holes: list[tuple[int, OperatorId]] = []
        damaged: list[tuple[int, OperatorId | None]] = []  # None: the point's manifest (any operator's entry)
        for it in self.points() if iterations is None else iterations:
            try:
                record = self._decode(it, self.backend.read_blob(it, MANIFEST))
            except FileNotFoundError:
                if it in self.points():  # a point without manifest; a concurrently deleted one is silent
                    problems.append(Problem(it, "point", "manifest missing"))
                    damaged.append((it, None))
                continue
            except CorruptEntryError as exc:
                problems.append(Problem(it, "point", exc.reason))
                damaged.append((it, None))
                continue
            bad, fetched = [], []
            for entry in record.all_entries():
                size = self.backend.blob_size(it, entry.blob)
                if size == entry.nbytes:
                    if entry.remote:  # fetched from a replica peer: held here now
                        fetched.append(entry)
                    continue
                if entry.remote:  # held by the replica peers only: a hole, not a problem
                    assert entry.op is not None, "a remote entry is an operator's FULL entry"
                    holes.append((it, entry.op))
                    if size is None:
                        continue
                reason = "file missing" if size is None else f"size {size} != {entry.nbytes} in manifest"
                problems.append(Problem(it, entry.name, reason))
                bad.append(entry)
                if entry.op is not None and entry.level == Level.FULL and not entry.remote:
                    damaged.append((it, entry.op))
            entries = {op: e for op, e in record.entries.items() if e.remote or e not in bad}
            entries.update({e.op: replace(e, remote=False) for e in fetched if e.op is not None})  # all remote
            meta = None if record.meta in bad else record.meta
            points[it] = replace(record, entries=entries, meta=meta)
        for problem in problems if report else ():
            logger.warning("moe-ft store %s: skipping %s", self.backend.describe(), problem)
        return Catalog(points, problems, holes, damaged)

    # -- reading ---------------------------------------------------------------------------------------
    def _manifest(self, iteration: int) -> PointRecord | None:
        try:
            data = self.backend.read_blob(iteration, MANIFEST)
        except FileNotFoundError:
            return None
        return self._decode(iteration, data)

    def _entry(self, catalog: Catalog | None, ref: EntryRef) -> tuple[EntryRecord, str]:
        # Without a catalog, trust only the manifest: a listed entry whose file is torn or missing must
        # surface as CorruptEntryError from _read, not as "missing".
        point = self._manifest(ref.iteration) if catalog is None else catalog.point(ref.iteration)
        entry = None if point is None else (point.meta if ref.op is None else point.entries.get(ref.op))
        if point is not None and entry is not None and ref.op is not None and entry.level != ref.level:
            entry = point.shadowed.get(ref.op, entry)  # the owner's COMPUTE entry beside a remote FULL one
        if point is None or entry is None or (ref.op is not None and entry.level != ref.level):
            level = "?" if ref.level is None else Level(ref.level).name
            what = "metadata" if ref.op is None else f"{ref.op} at level {level}"
            raise MissingEntryError(f"no valid {what} in point {ref.iteration} of {self.backend.describe()} "
                                    f"(published points: {self.points()})")
        return entry, point.checksum_algo

    def _read(self, entry: EntryRecord, algo: str, out) -> Any:
        where = self._where(entry.iteration, entry.blob)
        size = self.backend.blob_size(entry.iteration, entry.blob)
        if size is None and entry.remote:
            raise MissingEntryError(f"{entry.name} of iteration {entry.iteration} in {self.backend.describe()} is "
                                    "held by the replica peers only (--ft-optimizer-recompute-local compute) and "
                                    "was not fetched from them; recovery fetches it before loading")
        if size != entry.nbytes:
            raise CorruptEntryError(where, "file missing" if size is None
                                    else f"file is {size} bytes, manifest says {entry.nbytes} (torn write?)")
        if entry.checksum == PENDING and entry.iteration not in self._unverified_warned:
            self._unverified_warned.add(entry.iteration)
            logger.warning("moe-ft store %s: iteration %d is not verified yet (its digests are the node agent's "
                           "to record, and it has not): its entries' structure is checked, not their bytes",
                           self.backend.describe(), entry.iteration)
        try:
            with self.backend.open_blob(entry.iteration, entry.blob) as stream:
                return read_entry(stream, size=entry.nbytes, checksum=entry.checksum, algo=algo,
                                  key=entry.key, where=where, out=out)
        except FileNotFoundError:
            raise CorruptEntryError(where, "file disappeared (deleted while reading?)") from None

    def load(self, iteration: int, op: OperatorId, level: Level, *, out: Mapping[str, torch.Tensor] | None = None,
             catalog: Catalog | None = None) -> dict[str, torch.Tensor]:
        """The verified tensors of entry (iteration, op, level); into ``out``'s buffers if given.
        Raises :class:`MissingEntryError` or :class:`CorruptEntryError`."""
        entry, algo = self._entry(catalog, EntryRef(iteration, op, Level(level)))
        return self._read(entry, algo, out).tensors

    def load_meta(self, iteration: int, *, out: Mapping[str, torch.Tensor] | None = None,
                  catalog: Catalog | None = None) -> MetaEntry:
        entry, algo = self._entry(catalog, EntryRef(iteration))
        decoded = self._read(entry, algo, out)
        return MetaEntry(decoded.header.get("meta", {}), decoded.tensors)

    def verify_entry(self, entry: EntryRecord, algo: str) -> str | None:
        """``None`` if the entry's bytes match its checksum, else the reason."""
        try:
            self._read(entry, algo, None)
        except CorruptEntryError as exc:
            return exc.reason
        except MissingEntryError:
            return "held by the replica peers, not fetched"
        return None

    def add_blob(self, iteration: int, entry: EntryRecord, data: bytes) -> None:
        """Put the file of remote entry ``entry`` (fetched from a replica peer) into published point
        ``iteration``, after checking ``data`` against the manifest's size and checksum; the manifest does
        not change. Raises ``CorruptEntryError`` (nothing is written then)."""
        record = self._manifest(iteration)
        listed = None if record is None or entry.op is None else record.entries.get(entry.op)
        if record is None or listed is None or not listed.remote or listed != entry:
            raise ValueError(f"{entry.name} is not a remote entry of point {iteration} in {self.backend.describe()}")
        _check_bytes(data, entry, record.checksum_algo, self._where(iteration, entry.blob), "fetched")
        self.backend.add_blob(iteration, entry.blob, data)

    def read_verified(self, entry: EntryRecord, algo: str) -> bytes:
        """The stored bytes of ``entry``, read once and checked against its checksum: what is returned is
        what was verified, even if the space is reused right after (a copy to another tier). Raises
        :class:`CorruptEntryError`."""
        where = self._where(entry.iteration, entry.blob)
        try:
            data = self.backend.read_blob(entry.iteration, entry.blob)
        except FileNotFoundError:
            raise CorruptEntryError(where, "file missing") from None
        _check_bytes(data, entry, algo, where, "stored")
        return data

    def verify(self, iterations: Iterable[int] | None = None) -> Catalog:
        """Checksum every entry; the returned catalog holds only verified entries, with all problems."""
        catalog = self.catalog(iterations)
        for point in catalog.points():
            for entry in point.all_entries():
                if entry.remote and (entry.iteration, entry.op) in catalog.holes:
                    continue
                reason = self.verify_entry(entry, point.checksum_algo)
                if reason is not None:
                    logger.warning("moe-ft store %s: skipping iteration %d %s: %s", self.backend.describe(),
                                   entry.iteration, entry.name, reason)
                    catalog = catalog.without(entry.iteration, entry, reason)
        return catalog

    # -- recovery queries --------------------------------------------------------------------------------
    def newest_full(self, op: OperatorId, at_or_before: int | None = None) -> int | None:
        """Iteration of ``op``'s newest FULL entry at or before ``at_or_before`` (lossy recovery)."""
        return self.catalog().newest_full(op, at_or_before)

    def newest_recoverable(self, rule: RecoveryRule, *, at_or_before: int | None = None,
                           verify: bool = False, report: bool = True) -> RecoveryPoint | None:
        """Newest recovery point ``rule`` accepts. With ``verify`` every entry it needs is checksummed
        first; a corrupt one is skipped with a warning and the search continues without it. ``report``: as
        :meth:`catalog`'s (checksum failures are reported either way)."""
        catalog = self.catalog(report=report)
        verified: set[EntryRef] = set()
        while True:
            point = newest_recoverable(catalog, rule, at_or_before)
            if point is None or not verify:
                return point
            for ref in point.entries:
                if ref in verified:
                    continue
                entry, algo = self._entry(catalog, ref)
                reason = self.verify_entry(entry, algo)
                if reason is not None:
                    logger.warning("moe-ft store %s: skipping iteration %d %s: %s", self.backend.describe(),
                                   ref.iteration, entry.name, reason)
                    catalog = catalog.without(ref.iteration, entry, reason)
                    break
                verified.add(ref)
            else:
                return point

    # -- deletion ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def pin(self, iterations: Iterable[int]) -> Iterator[None]:
        """Keep ``iterations`` from garbage collection while the block runs (a replication or persistence
        thread reading them, a recovery loading them)."""
        its = list(iterations)
        with self._lock:
            self._pins.update(its)
        try:
            with self.backend.pin_elsewhere(its) if self.shared_pins else contextlib.nullcontext():
                yield
        finally:
            with self._lock:
                self._pins.subtract(its)
                self._pins += Counter()  # drop zero counts

    def delete_point(self, iteration: int) -> None:
        with self._lock:
            if self._pins[iteration] > 0:
                raise StoreError(f"point {iteration} is pinned (being read); unpin before deleting it")
        self.backend.delete_point(iteration)
        self._forget(iteration)
        self._drop_verified([iteration])

    def _forget(self, iteration: int) -> None:
        with self._lock:
            self._written.pop(iteration, None)

    def discard_after(self, iteration: int) -> list[int]:
        """Delete every published point newer than ``iteration`` (after rolling back to it)."""
        doomed = [it for it in self.points() if it > iteration]
        for it in doomed:
            self.delete_point(it)
        return doomed

    def _gc_catalog(self) -> Catalog:
        """The catalogue garbage collection decides on: the remembered record of every listed point this
        store object published (the backend keeps published points immutable, so re-reading its manifest
        and stat-ing its entries would return what was written), the full checks of :meth:`catalog` for
        every other point (written by another process, e.g. before a restart). GC runs after every
        publish; this keeps its cost independent of the number of entries per point."""
        listed = self.points()
        with self._lock:
            known = {it: self._written[it][1] for it in listed if it in self._written}
        others = [it for it in listed if it not in known]
        if not others:
            return Catalog(known)
        checked = self.catalog(others)
        return Catalog({**known, **{p.iteration: p for p in checked.points()}}, checked.problems, checked.holes,
                       checked.damaged)

    def gc(self) -> list[int]:
        """Delete the points the retention policy does not keep (and leftovers of dead writers)."""
        if self.retention is None:
            return []
        catalog = self._gc_catalog()
        keep = self.retention.keep(catalog)
        # the pins are read and the points deleted under one lock: a thread of this process that pins a
        # point meanwhile (a replication sender) waits, then finds it deleted, instead of reading regions
        # the next point is given
        with self._lock:
            pinned = {it for it, n in self._pins.items() if n > 0}
            pinned |= self.backend.pinned_elsewhere()
            # Unreadable points are not in the catalog: the policy cannot vouch for them, and they must not
            # pile up, so they go once older than the oldest kept point.
            oldest_kept = min(keep | pinned, default=None)
            listed = self.points()
            doomed = [it for it in listed if it not in keep and it not in pinned
                      and (it in catalog.iterations or (oldest_kept is not None and it < oldest_kept))]
            for it in doomed:
                self.backend.delete_point(it)
                self._written.pop(it, None)
        if self.defer_checksums or doomed:
            self._drop_verified(None if self.defer_checksums else doomed)
        self.backend.sweep_staging()
        return doomed
