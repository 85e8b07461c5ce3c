"""Publishing a point in another process: the trainer copies, the node agent seals, publishes and collects.

The trainer's part of a snapshot is its one copy of each tensor into a region of its arena (by the copy
engine or the hash kernel on a GPU, by the copy that hashes on CPU) and the tensors' ``mfh64`` lane sums that
copy produced. Everything after it is host work on small data: each entry's header, padding and digest, the
manifest, the index, garbage collection by the retention policy (``docs/benchmarks.md``: about 2 ms of Python
per point on the trainer's snapshot thread, which a launch-bound training thread waits behind for the GIL).
With ``--ft-publish-by agent`` the trainer sends a :class:`PublishOrder` -- where each entry's region is, its
layout and its lane sums -- to the node agent, which does that work in its own process
(:func:`finish_point`) and answers when the point is published.

Who owns what stays as in ``moe_ft/store/arena.py``: the trainer's allocator hands out every region (the
manifest's included, sized before the manifest exists: :func:`manifest_room`), and takes a point's regions as
the point's once the agent answered (``_ArenaWriter.handed_over``). The agent writes only into the regions the
order names, links the index (``link(2)``, atomic, refuses an existing point) and deletes the points the
retention policy drops by unlinking their indexes; the allocator frees those regions when it next looks
(``_Allocator._reclaim``), and keeps those a reader still pins.

Failures, none of which leaves a torn or corrupt point visible:

* the trainer is killed after it sent the order: the copy had ended (the order is sent after it), so the
  agent publishes a complete point, holding the arena's lock while it links the index (:func:`_for_writer`);
  the allocator of the trainer's next attempt reads it from its index. The agent refuses to link when another
  process took the arena since (``arena/LOCK`` names another pid): that allocator may have handed the regions
  out again;
* the agent is killed before it linked the index: nothing is published; the trainer's client starts another
  agent and sends the order again, and the new agent writes the point again (sealing is a function of the
  order); after the link: the index exists, and the order sent again finds it naming the order's regions and
  is answered without a byte written (a published point is never written again);
* the agent does not answer within the trainer's bound (stopped, stuck): the trainer withdraws the order
  before it frees its regions, and the agent claims an order before it writes a byte, so a late agent writes
  nothing into regions given to later points (``moe_ft/store/order_claim.py``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import pickle
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import order_claim
from moe_ft.store.arena import ALIGN as PAGE
from moe_ft.store.arena import ArenaBackend, Region, _read_index, _write_index
from moe_ft.store.backend import MANIFEST, pid_alive
from moe_ft.store.codec import (
    ALIGN,
    DTYPES,
    EntryLayout,
    WrittenEntry,
    check_tensor,
    dtype_name,
    encode_meta,
    raw_bytes,
    write_entry,
)
from moe_ft.store.errors import StoreError
from moe_ft.store.manifest import (
    META_BLOB,
    EntryRecord,
    TensorRecord,
    build_manifest,
    entry_key,
    entry_record,
    seal_from_sums,
)

if TYPE_CHECKING:
    from moe_ft.store.retention import RetentionPolicy
    from moe_ft.store.store import SnapshotStore


@dataclass(frozen=True)
class EntryKind:
    """An operator entry as it is at every point that holds it (its operator, level, blob and layout): sent to
    the agent once (:attr:`PublishOrder.kinds`), then named by number in :attr:`PublishOrder.unsealed`."""

    op: OperatorId
    level: Level
    blob: str
    layout: int
    """The id of its :class:`~moe_ft.store.codec.EntryLayout` in :attr:`PublishOrder.layouts` (or sent before)."""


Unsealed = tuple[int, list[list[int]]]
"""An operator entry whose tensors' bytes are in place in its region (``PublishOrder.blobs[kind.blob]``):
``(the number of its EntryKind, each tensor's mfh64 lane sums from the copy that put it there)``; the agent
writes its header, padding and digest around them (``moe_ft.store.codec.seal_entry``). Plain data: an order
is pickled on the trainer's snapshot thread at every point."""


@dataclass(frozen=True)
class MetaOrder:
    """The metadata entry, encoded and written by the agent: the trainer pickles its dict (C speed) and copies
    its small tensors' bytes, instead of JSON-encoding, hashing and writing the entry on its snapshot thread."""

    meta: bytes
    """``pickle`` of the metadata dict (JSON-able: the agent encodes it as ``put_meta`` would)."""
    tensors: tuple[tuple[str, str, tuple[int, ...], bytes], ...]
    """``(name, dtype name, shape, bytes)`` of each tensor, in order."""

    @classmethod
    def of(cls, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> "MetaOrder":
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.fast = True  # no memo: an object met twice is pickled twice, as JSON spells it twice (room())
        pickler.dump(dict(meta))
        return cls(out.getvalue(), tuple((name, dtype_name(t.dtype), tuple(t.shape),
                                          raw_bytes(check_tensor(name, t)).tobytes()) for name, t in tensors.items()))

    def record(self, iteration: int) -> EntryRecord:
        """The entry's record but its digest (``nbytes`` at most :meth:`room`): what the manifest reserved for
        it is sized by (``manifest.entry_json_bound``)."""
        return EntryRecord(iteration, None, None, META_BLOB, self.room(), "",
                           tuple(TensorRecord(name, dtype, shape, len(data)) for name, dtype, shape, data in self.tensors))

    def room(self) -> int:
        """Bytes the entry takes at most. Its JSON is at most 8 bytes per byte of the pickle (pickled without a
        memo): the widest is ``false,`` for the one byte of ``False``, a control character's ``\\u0000`` for its
        one byte, three times a non-ASCII character's UTF-8 bytes for its escapes; each tensor's record and
        alignment are bounded too."""
        need = 64 * 1024 + 8 * len(self.meta) + sum(len(data) + 2 * ALIGN + 512 + 8 * len(name) + 24 * len(shape)
                                                 for name, _, shape, data in self.tensors)
        return -(-need // PAGE) * PAGE

    def entry(self, iteration: int, checksum: str) -> tuple[bytes, WrittenEntry]:
        """The entry's bytes (``codec.write_entry``) and record."""
        meta = pickle.loads(self.meta)
        tensors = {name: torch.frombuffer(bytearray(data), dtype=DTYPES[dtype]).view(shape) if data
                   else torch.empty(shape, dtype=DTYPES[dtype]) for name, dtype, shape, data in self.tensors}
        try:
            meta_json = encode_meta(meta)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata of iteration {iteration} is not JSON-serialisable: {exc}") from None
        out = bytearray()
        written = write_entry(out.extend, entry_key(iteration, None, None), tensors, checksum, meta_json=meta_json)
        return bytes(out), written


@dataclass
class PublishOrder:
    """What the node agent needs to finish and publish rank ``rank``'s point ``iteration``."""

    rank: int
    store_dir: str
    iteration: int
    checksum: str
    writer_pid: int
    """The trainer process that allocated the regions (and must still hold the arena when the index is linked)."""
    unsealed: list[Unsealed]
    sealed: list[EntryRecord]
    """Entries the trainer wrote whole (digest included): the metadata entry's too, in :attr:`meta`."""
    meta: EntryRecord | None
    remote: list[EntryRecord]
    blobs: dict[str, Region]
    """Every region of the point but the manifest's: the index lists them."""
    manifest_region: Region
    """Where the manifest goes: at most its ``nbytes`` (:func:`manifest_room`)."""
    meta_order: MetaOrder | None = None
    """The metadata entry for the agent to write (then :attr:`meta` is ``None``), into :attr:`meta_region`."""
    meta_region: Region | None = None
    fsync: bool = False
    kinds: dict[int, EntryKind] = field(default_factory=dict)
    """The entry kinds this publisher has not sent before (the agent keeps those it was sent)."""
    layouts: dict[int, EntryLayout] = field(default_factory=dict)
    """The layouts of :attr:`kinds` this publisher has not sent before."""
    retention: "RetentionPolicy | None" = None
    """Garbage collection's policy, when it changed since the last order (``None``: the last one sent)."""
    retention_id: int = 0
    """Which policy the agent must hold (an order after an agent restart finds none: :class:`MissingState`)."""
    marker: str = ""
    """The point's staging marker, which the agent claims before it writes (``moe_ft/store/order_claim.py``);
    empty: no claim (a writer that cannot withdraw, e.g. a test's order)."""


class MissingState(LookupError):
    """The agent lacks an entry kind, a layout or the retention policy an order refers to (it was started again
    since): the trainer sends the order again with all of them."""


def manifest_room(bound: int) -> int:
    """Bytes to reserve for a manifest of at most ``bound`` bytes (``manifest.manifest_bound`` of its entries'
    tensor records, known when the point is handed over): whole pages. Not a guess from the last manifest of
    as many entries: the first has none, and a policy that saves other operators at each point (sparse, pec)
    names other tensors with as many entries; a manifest that does not fit fails the publish."""
    return -(-bound // PAGE) * PAGE


@contextlib.contextmanager
def _for_writer(directory: Path, pid: int) -> Iterator[bool]:
    """Whether the regions process ``pid`` allocated are still its to publish, for the duration of the block:
    ``arena/LOCK`` names it (a process that took the arena since writes its own pid there) and either it still
    holds the lock, alive, or nobody does and this process holds it for the block (the writer was killed after
    it sent its order: its regions are still free to no one, and no allocator can start meanwhile)."""
    if pid == os.getpid():  # published in the writing process itself (a test): it holds the lock; a lock taken and
        yield True  # closed here would drop it (POSIX record locks belong to the process, not the descriptor)
        return
    try:
        fd = os.open(directory / "arena" / "LOCK", os.O_RDWR)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            taken = False
        named = os.pread(fd, 32, 0).decode(errors="replace").strip() == str(pid)
        yield named and (taken or pid_alive(pid))
    finally:
        os.close(fd)  # drops the lock if it was taken here


class SegmentWriter:
    """Writable shared mappings of an arena's segments, in a process that does not allocate (the node agent).
    A mapping is made again when its file is no longer the segment's (the directory was made anew)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.arena_dir = Path(directory) / "arena"
        self._maps: dict[int, tuple[tuple[int, int], int, mmap.mmap]] = {}  # seg -> ((dev, ino), fd, mapping)

    def view(self, region: Region) -> memoryview:
        seg, off, n = region
        path = self.arena_dir / f"{seg:04d}"
        st = os.stat(path)
        known = self._maps.get(seg)
        if known is None or known[0] != (st.st_dev, st.st_ino) or len(known[2]) < off + n:
            self._drop(seg)
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            known = self._maps[seg] = ((st.st_dev, st.st_ino), fd, mm)
        return memoryview(known[2])[off:off + n]

    def fd(self, seg: int) -> int:
        return self._maps[seg][1]

    def _drop(self, seg: int) -> None:
        known = self._maps.pop(seg, None)
        if known is not None:
            with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with the process
                known[2].close()
            os.close(known[1])

    def close(self) -> None:
        for seg in list(self._maps):
            self._drop(seg)


@dataclass
class Finisher:
    """The node agent's side for one rank's store: the layouts and retention policy it was sent, the store
    it publishes into (a reader of the trainer's arena, pinning as other processes do) and its mappings."""

    store: "SnapshotStore"
    kinds: dict[int, EntryKind] = field(default_factory=dict)
    layouts: dict[int, EntryLayout] = field(default_factory=dict)
    retention_id: int = 0
    segments: SegmentWriter | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """One order at a time: a killed trainer's connection thread may still finish its last order while the
    next trainer of the rank publishes on another (the mappings, the kinds and garbage collection are shared)."""

    def finish(self, order: PublishOrder) -> dict[str, Any]:
        """:func:`finish_point` for this rank, one order at a time."""
        with self.lock:
            return finish_point(self, order)


def finish_point(state: Finisher, order: PublishOrder) -> dict[str, Any]:
    """Seal the order's entries, write its metadata entry and manifest, link its index, then collect garbage by
    the retention policy. Returns ``{"written": where the manifest (and metadata entry) went, "deleted"}``.
    Raises :class:`MissingState` (send it again with all layouts and the policy), :class:`StoreError` (a blob
    does not fit its region; the writer no longer holds the arena; the point exists with other regions),
    ``ValueError`` (metadata that is not JSON-able), ``OSError`` (a full file system)."""

    state.kinds.update(order.kinds)
    state.layouts.update(order.layouts)
    if order.retention is not None or order.retention_id == 0:
        state.store.retention, state.retention_id = order.retention, order.retention_id
    kinds = [state.kinds.get(kind) for kind, _ in order.unsealed]
    missing = [kind for (kind, _), known in zip(order.unsealed, kinds) if known is None or known.layout not in
               state.layouts]
    if missing or state.retention_id != order.retention_id:
        raise MissingState(f"entry kinds {missing[:3]} or retention policy {order.retention_id} not sent to this "
                           "agent")
    backend = state.store.backend
    assert isinstance(backend, ArenaBackend)
    rooms = {name: region for name, region in ((MANIFEST, order.manifest_region), (META_BLOB, order.meta_region))
             if region is not None}
    done = handed_over_anyway(backend, order.iteration, order.blobs, rooms)
    if done is not None:  # sent again after an agent that published it died: published once, nothing rewritten
        return {"written": done, "deleted": []}
    if order.marker and not order_claim.claim(backend.staging_dir, order.marker):
        raise StoreError(f"{backend.describe()}: point {order.iteration} not published: its writer (pid "
                         f"{order.writer_pid}) withdrew the order, having waited for the answer longer than its "
                         "bound, and may have written another point into its regions since")
    try:
        with _for_writer(backend.directory, order.writer_pid) as theirs:
            if not theirs:
                raise StoreError(f"{backend.describe()}: point {order.iteration} not published: another process "
                                 f"took the arena since its writer (pid {order.writer_pid}) allocated its regions")
            manifest, record, written = _write_and_link(state, order, kinds)
    finally:
        if order.marker:
            order_claim.release(backend.staging_dir, order.marker)
    state.store._remember(order.iteration, manifest, record)
    deleted = state.store.gc() if state.store.retention is not None else []
    return {"written": written, "deleted": deleted}


def _write_and_link(state: Finisher, order: PublishOrder, kinds: list) -> tuple[bytes, Any, dict[str, Region]]:
    """Seal the entries, write the metadata entry and manifest, link the index (the caller holds the order and
    checked that its writer still holds the arena, or holds it itself). Returns the manifest, its record and
    where the blobs the agent wrote went."""
    backend = state.store.backend
    assert isinstance(backend, ArenaBackend)
    if state.segments is None:
        state.segments = SegmentWriter(backend.directory)
    entries = list(order.sealed)
    for kind, (_, sums) in zip(kinds, order.unsealed):
        assert kind is not None  # MissingState above
        layout, region = state.layouts[kind.layout], order.blobs[kind.blob]
        written = seal_from_sums(state.segments.view(region), layout, order.iteration, kind.op, kind.level,
                                 order.checksum, sums)
        entries.append(EntryRecord(order.iteration, kind.op, kind.level, kind.blob, written.nbytes, written.checksum,
                                   state.store._tensor_records(layout)))
        if order.fsync:
            os.fsync(state.segments.fd(region[0]))
    meta, blobs = order.meta, dict(order.blobs)
    if order.meta_order is not None:
        assert order.meta_region is not None, "a metadata entry goes with its region"
        data, meta_written = order.meta_order.entry(order.iteration, order.checksum)
        blobs[META_BLOB] = _put(state.segments, backend, order, order.meta_region, data, "metadata entry")
        meta = entry_record(order.iteration, None, None, META_BLOB, meta_written)
    manifest, record = build_manifest(order.iteration, order.checksum, entries, meta, order.remote,
                                      writer_pid=order.writer_pid)
    blobs[MANIFEST] = _put(state.segments, backend, order, order.manifest_region, manifest, "manifest")
    try:
        _write_index(backend.points_dir, order.iteration, blobs, replace=False, fsync=order.fsync)
    except FileExistsError:
        raise StoreError(f"{backend.describe()}: point {order.iteration} is already published with other "
                         "regions") from None
    return manifest, record, {name: blobs[name] for name in blobs if name not in order.blobs}


def _put(segments: SegmentWriter, backend: ArenaBackend, order: PublishOrder, region: Region, data: bytes,
         what: str) -> Region:
    """Write ``data`` at the start of ``region`` (reserved by the trainer for it); returns where it is."""
    seg, off, room = region
    if len(data) > room:
        raise StoreError(f"{backend.describe()} point {order.iteration}: {what} of {len(data)} bytes for a region "
                         f"of {room}")
    view = segments.view((seg, off, len(data)))
    view[:] = data
    del view
    if order.fsync:
        os.fsync(segments.fd(seg))
    return (seg, off, len(data))


def handed_over_anyway(backend: Any, iteration: int, blobs: dict[str, Region],
                       rooms: dict[str, Region]) -> dict[str, Region] | None:
    """After a failed order: where the agent put the blobs it wrote into ``rooms`` (the manifest's, the metadata
    entry's) when point ``iteration``'s index exists and names exactly ``blobs`` and those blobs at their rooms'
    places (the publisher linked it, then died or failed), else ``None`` (nothing of the point is visible)."""
    found = _read_index(backend.points_dir / f"{iteration:012d}.json")
    if found is None or set(found) != set(blobs) | set(rooms):
        return None
    written = {name: found.pop(name) for name in rooms}
    fits = all(w[:2] == r[:2] and w[2] <= r[2] for w, r in ((written[n], rooms[n]) for n in rooms))
    return written if found == blobs and fits else None


__all__ = ["EntryKind", "Finisher", "MetaOrder", "MissingState", "PublishOrder", "SegmentWriter", "Unsealed", "finish_point",
           "handed_over_anyway", "manifest_room"]
