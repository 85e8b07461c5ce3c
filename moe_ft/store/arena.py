"""Arena backend: a rank's points live in regions of a few preallocated files; publishing a point writes
and renames one small index file. Layout (see ``docs/store.md``, "The arena")::

    <dir>/FORMAT.json                    {"format": "moe-ft-store", "version": 2, "layout": "arena"}
    <dir>/arena/<k:04d>                  segments: fallocated once, never truncated or unlinked while the
                                         store exists (a reader or a device mapping may hold them)
    <dir>/arena/LOCK                     the allocating process's lock (``lockf``) and pid
    <dir>/points/<iteration:012d>.json   index of a published point: {"blobs": {name: [segment, offset, nbytes]}}
    <dir>/staging/<iteration:012d>.<pid>.<n>   marker of a point being written (or left by a killed writer)

Why (Flash Checkpoint's and DCP's designs, measured here in ``docs/store.md``): a file store pays, for every
snapshot byte, a page allocation and zero-fill on tmpfs whenever no recycled file fits, and a directory of
files per point; the arena's pages are allocated once (``posix_fallocate``, so a full tmpfs is an
``ENOSPC`` at growth, never a ``SIGBUS`` on a mapped page) and every later point reuses them. The same
bytes can be mapped once and page-locked for device-to-host copies that land in their region directly.

Guarantees (the :class:`StoreBackend` contract, ``tests/test_store_contract.py``):

* **Atomic publish.** A point's blobs are written into free regions; it becomes visible when its index is
  linked into ``points/`` (one ``link(2)``, which also refuses an existing point). A writer killed before
  that leaves regions that no index names: free space to the next allocator, nothing that looks published.
* **Immutability.** A region named by a published index is never handed out again until the index is
  unlinked (``delete_point``: invisible first, then free). Adding a blob to a published point writes a
  new region and replaces the index (``rename(2)``).
* **One allocating process per directory.** The first process that writes takes a ``lockf`` lock on
  ``arena/LOCK`` and keeps it until it exits (the kernel drops it with the process, a ``SIGKILL`` too);
  a second process that tries to write gets a :class:`StoreError` naming the holder. Readers (recovery of
  another rank, ``moe-ft inspect``) take no lock and only read. Within one process every backend object of
  a directory shares one allocator.

Deleting from another process (only the index is unlinked) leaks nothing: before the allocator grows the
arena it drops the regions of points whose index has disappeared.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import itertools
import json
import mmap
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from moe_ft.store import order_claim
from moe_ft.store.backend import (
    MANIFEST,
    BlobSink,
    FaultHook,
    PointWriter,
    StagingInfo,
    StoreBackend,
    format_file,
    pid_alive,
    valid_blob_name,
)
from moe_ft.store.errors import StoreError

if TYPE_CHECKING:
    import torch

FORMAT = {"format": "moe-ft-store", "version": 2, "layout": "arena"}
FORMAT_FILE = "FORMAT.json"
ALIGN = 4096
"""Region alignment (a page: a region never shares a page with another, and device copies are aligned)."""
MIN_SEGMENT = 4 << 20
GROWTH = 4
"""A new segment is at least ``1/GROWTH`` of the arena so far: a few segments per store, and an arena at
most ``1 + 1/GROWTH`` times the largest amount of data the retention rule ever kept."""
LOCK_WAIT_S = 5.0
"""How long a writer waits for the lock of a predecessor that is exiting (killed, not yet reaped)."""
_INDEX_CACHE_SWEEP = 64
"""Cached point indexes a reader holds before it first looks for those of deleted points (then whenever the
cache doubled since the last look): a handful of points exist at a time, so the bound is a few times that."""

Region = tuple[int, int, int]  # (segment, offset, nbytes)


def _align(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _pwrite_all(fd: int, buf: Any, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_index(points_dir: Path, iteration: int, blobs: dict[str, Region], *, replace: bool, fsync: bool) -> None:
    """Publish (``replace=False``: refuse an existing point) or update the index of ``iteration``."""
    final = points_dir / f"{iteration:012d}.json"
    tmp = points_dir / f".{iteration:012d}.{os.getpid()}.{threading.get_ident()}.tmp"
    data = json.dumps({"iteration": iteration, "blobs": {n: list(r) for n, r in sorted(blobs.items())}},
                      separators=(",", ":")).encode()
    try:
        with open(tmp, "wb") as f:  # inside the try: a full file system leaves no temporary file behind
            f.write(data)
            if fsync:
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)  # atomic, and fails if the point exists (rename would overwrite it)
            except FileExistsError:
                raise FileExistsError(f"point {iteration} is already published at {final}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class _Allocator:
    """Regions of one store directory, for the one process that writes it (module docstring)."""

    def __init__(self, directory: Path, fsync: bool) -> None:
        self.directory = directory
        self.arena_dir = directory / "arena"
        self.fsync = fsync
        self.lock = threading.RLock()
        self._lock_fd = self._take_lock()
        st = os.fstat(self._lock_fd)
        self._lock_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
        self._pid = os.getpid()  # a forked child inherits this object, not the lock
        self.fds: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self._free: list[list[int]] = []  # [segment, offset, nbytes], sorted, coalesced
        self.points: dict[int, list[Region]] = {}  # published points this allocator knows of
        self.pending: dict[int, list[Region]] = {}  # writer token -> regions not published yet
        self.open_tokens: set[int] = set()  # writers that may still allocate (not published, not aborted)
        self.deferred: dict[int, list[Region]] = {}  # deleted points another process still reads (see delete)
        self.in_doubt: dict[int, tuple[int, str]] = {}  # writer token -> (iteration, marker): an agent holds it (settle)
        self.pinned: Callable[[], set[int]] = set  # the points other processes pin (the backend sets it)
        self.maps: dict[int, torch.Tensor] = {}  # segment -> its bytes, mapped shared (map_blob), never unmapped
        self._mms: dict[int, mmap.mmap] = {}  # segment -> its shared mapping, never unmapped
        # segment -> its mapping's address and the export that keeps it (None, None: cannot be mapped)
        self._addrs: dict[int, tuple[int, ctypes.c_char] | tuple[None, None]] = {}
        for name in sorted(os.listdir(self.arena_dir)):
            if name.isdigit():
                seg = int(name)
                fd = os.open(self.arena_dir / name, os.O_RDWR)
                size = os.fstat(fd).st_size
                if size == 0:  # a writer killed between creating the segment and allocating it: no index names it
                    os.close(fd)
                    os.unlink(self.arena_dir / name)
                    continue
                self.fds[seg], self.sizes[seg] = fd, size
        used: list[Region] = []
        for it, blobs in _read_indexes(directory / "points").items():
            self.points[it] = [r for r in blobs.values() if r[0] in self.sizes]
            used += self.points[it]
        self._rebuild_free(used)

    def current(self) -> bool:
        """Whether the directory is still the one this allocator opened, in the process that opened it."""
        if os.getpid() != self._pid:
            return False
        try:
            st = os.stat(self.arena_dir / "LOCK")
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._lock_id

    def close(self) -> None:
        self._lock_id = None
        for fd in [*self.fds.values(), self._lock_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def _take_lock(self) -> int:
        self.arena_dir.mkdir(exist_ok=True)
        fd = os.open(self.arena_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise StoreError(f"{self.directory} is written by another process (pid {holder}); one process "
                                     "writes a store directory: give each rank its own --ft-store-dir/job, or stop "
                                     "the other job") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _rebuild_free(self, used: list[Region]) -> None:
        free: list[list[int]] = []
        by_seg: dict[int, list[tuple[int, int]]] = {}
        for seg, off, n in used:
            by_seg.setdefault(seg, []).append((off, _align(n)))
        for seg, size in sorted(self.sizes.items()):
            pos = 0
            for off, n in sorted(by_seg.get(seg, [])):
                if off > pos:
                    free.append([seg, pos, off - pos])
                pos = max(pos, off + n)
            if size > pos:
                free.append([seg, pos, size - pos])
        self._free = free

    def open(self, token: int) -> None:
        """A writer begins: it may allocate until it is published or aborted."""
        with self.lock:
            self.open_tokens.add(token)

    def allocate(self, nbytes: int, token: int) -> Region:
        return self.allocate_many((nbytes,), token)[0]

    def allocate_many(self, sizes, token: int) -> list[Region]:
        """A region of each of ``sizes`` bytes for writer ``token``, under one hold of the lock."""
        with self.lock:
            if token not in self.open_tokens:  # a thread still writing for an aborted point must not take regions
                raise StoreError(f"{self.directory}: a region was asked for a point writer that was already "
                                 "published or aborted (a write that outlived its point)")
            return [self._allocate(nbytes, token) for nbytes in sizes]

    def _allocate(self, nbytes: int, token: int) -> Region:
        """Best fit, else what other processes freed, else a new segment (the lock is held)."""
        need = _align(nbytes)
        slot = self._best_fit(need)
        if slot is None:
            self._reclaim()
            slot = self._best_fit(need)
        if slot is None:
            self._grow(need)
            slot = self._best_fit(need)
        assert slot is not None
        seg, off, size = self._free[slot]
        if size == need:
            del self._free[slot]
        else:
            self._free[slot] = [seg, off + need, size - need]
        region = (seg, off, nbytes)
        self.pending.setdefault(token, []).append(region)
        return region

    def _best_fit(self, need: int) -> int | None:
        best = None
        for i, (_, _, size) in enumerate(self._free):
            if size >= need and (best is None or size < self._free[best][2]):
                best = i
                if size == need:
                    break
        return best

    def _release(self, regions: list[Region]) -> None:
        for seg, off, n in regions:
            n = _align(n)
            i = bisect.bisect_left(self._free, [seg, off, n])
            self._free.insert(i, [seg, off, n])
            if i + 1 < len(self._free):  # merge with the next extent
                nseg, noff, nn = self._free[i + 1]
                if nseg == seg and noff == off + n:
                    self._free[i][2] += nn
                    del self._free[i + 1]
            if i > 0:  # and with the previous one
                pseg, poff, pn = self._free[i - 1]
                if pseg == seg and poff + pn == off:
                    self._free[i - 1][2] += self._free[i][2]
                    del self._free[i]

    def doubt(self, token: int, iteration: int, marker: str) -> None:
        """Writer ``token`` handed its regions to a node agent that did not answer and still holds the order
        (``moe_ft/store/order_claim.py``): they stay allocated, neither free nor a point's, until it lets go."""
        with self.lock:
            self.open_tokens.discard(token)
            self.in_doubt[token] = (iteration, marker)

    def settle(self) -> None:
        """The regions of orders an agent no longer holds: the point's where it linked the point's index with
        them, else free (the lock is held)."""
        for token, (iteration, marker) in list(self.in_doubt.items()):
            if order_claim.holder(self.directory / "staging", marker) is not None:
                continue
            del self.in_doubt[token]
            index = _read_index(self.directory / "points" / f"{iteration:012d}.json")
            mine = {(seg, off) for seg, off, _ in self.pending.get(token, [])}
            if index is not None and {(seg, off) for seg, off, _ in index.values()} <= mine:
                self.published(token, iteration, list(index.values()))
            else:
                self._release(self.pending.pop(token, []))

    def _reclaim(self) -> None:
        """Free the regions of points deleted by another process (their index is gone: the node agent's garbage
        collection, ``moe_ft/store/handoff.py``), but not those a reader pins now: it may have found the index
        before it went (as in :meth:`delete`, the pins are read after the index is seen gone); and settle the
        orders an agent held (:meth:`settle`)."""
        if self.in_doubt:
            self.settle()
        gone = [it for it in self.points if not os.path.exists(self.directory / "points" / f"{it:012d}.json")]
        if not gone and not self.deferred:
            return
        now = self.pinned()
        for it in gone:
            regions = self.points.pop(it)
            if it in now:
                self.deferred.setdefault(it, []).extend(regions)  # a re-published iteration pinned again
            else:
                self._release(regions)
        for it in [it for it in self.deferred if it not in now]:
            self._release(self.deferred.pop(it))

    def _grow(self, need: int) -> None:
        """Add a segment of at least ``need`` bytes: ``1/GROWTH`` of the arena, at least ``MIN_SEGMENT``; where
        the file system has no room for that, of ``need`` only (a store on a small tmpfs keeps taking snapshots
        rather than pausing them while the bytes they need are there)."""
        total = sum(self.sizes.values())
        size = max(-(-need // (1 << 20)) * (1 << 20), MIN_SEGMENT, total // GROWTH // ALIGN * ALIGN)
        seg = max(self.sizes, default=-1) + 1
        path = self.arena_dir / f"{seg:04d}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # pages now: a full tmpfs fails here, not at a later page fault
            except OSError as exc:
                if exc.errno != errno.ENOSPC or size <= _align(need):
                    raise
                os.ftruncate(fd, 0)  # the pages the attempt took go back
                size = _align(need)
                os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        self.fds[seg], self.sizes[seg] = fd, size
        self._release([(seg, 0, size)])

    def _mmap(self, seg: int) -> mmap.mmap:
        """Segment ``seg``'s shared mapping, mapped once and kept for the process's life (a page-locked
        mapping must never go away under a device copy; segments are never truncated)."""
        with self.lock:
            mm = self._mms.get(seg)
            if mm is None:
                mm = self._mms[seg] = mmap.mmap(self.fds[seg], self.sizes[seg], mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)
            return mm

    def mapping(self, seg: int) -> torch.Tensor:
        """Segment ``seg``'s bytes as a ``uint8`` tensor over its shared mapping."""
        with self.lock:
            view = self.maps.get(seg)
            if view is None:
                import torch  # start-up time: readers of the arena (the node agent, moe-ft inspect) never need it

                view = self.maps[seg] = torch.frombuffer(self._mmap(seg), dtype=torch.uint8)
            return view

    def address(self, seg: int) -> int | None:
        """The address of segment ``seg``'s shared mapping in this process (valid for the process's life), or
        ``None`` where the file system cannot map it shared (the writer then uses ``pwrite``)."""
        with self.lock:
            found = self._addrs.get(seg)
            if found is None:
                try:
                    export = ctypes.c_char.from_buffer(self._mmap(seg))
                    found = (ctypes.addressof(export), export)
                except OSError:  # e.g. ENODEV: a file system without shared writable mappings
                    found = None, None
                self._addrs[seg] = found
            return found[0]

    def abort(self, token: int) -> None:
        with self.lock:
            self.open_tokens.discard(token)
            self._release(self.pending.pop(token, []))

    def published(self, token: int, iteration: int, regions: list[Region]) -> None:
        """The writer's index is linked: its regions now belong to the point (the rest, e.g. blobs opened
        and never closed, go back)."""
        with self.lock:
            self.open_tokens.discard(token)
            mine = self.pending.pop(token, [])
            kept = {(seg, off) for seg, off, _ in regions}  # by place: a blob may be shorter than reserved
            self._release([r for r in mine if (r[0], r[1]) not in kept])
            self.points.setdefault(iteration, []).extend(r for r in mine if (r[0], r[1]) in kept)

    def delete(self, index: Path, iteration: int, pinned: Callable[[], set[int]]) -> bool:
        """Hide point ``iteration`` (unlink its index), then free its regions, unless a reader of another
        process pinned it in the meantime (``pinned()``, read once the index is gone): garbage collection chose
        it from the pins it read before, and that reader may hold the index's places already. Such regions
        are kept until a later deletion finds the pin gone; a reader that pins after the unlink finds no
        index, so nothing else can need them."""
        with self.lock:
            try:
                os.unlink(index)  # invisible from here on
                existed = True
            except FileNotFoundError:
                existed = False
            now = pinned()
            regions = self.points.pop(iteration, [])
            if existed and iteration in now:
                self.deferred.setdefault(iteration, []).extend(regions)  # not the earlier deferral's
            else:
                self._release(regions)
            for it in [it for it in self.deferred if it not in now]:
                self._release(self.deferred.pop(it))
            return existed

    def allocated(self, token: int) -> int:
        with self.lock:
            return sum(n for _, _, n in self.pending.get(token, []))

    def arena_bytes(self) -> int:
        return sum(self.sizes.values())


def _read_indexes(points_dir: Path) -> dict[int, dict[str, Region]]:
    out = {}
    for name in os.listdir(points_dir) if points_dir.exists() else ():
        if name.endswith(".json") and name[:-5].isdigit():
            blobs = _read_index(points_dir / name)
            if blobs is not None:
                out[int(name[:-5])] = blobs
    return out


def _read_index(path: Path) -> dict[str, Region] | None:
    """The blobs of an index; ``None`` if it is missing or unreadable (a damaged index: the point holds
    nothing readable, and the catalogue reports its manifest missing)."""
    try:
        data = json.loads(path.read_bytes())
        return {str(n): (int(r[0]), int(r[1]), int(r[2])) for n, r in data["blobs"].items()}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


_ALLOCATORS: dict[str, _Allocator] = {}
_ALLOCATORS_LOCK = threading.Lock()


def _allocator(directory: Path, fsync: bool) -> _Allocator:
    """This process's allocator of ``directory``; a new one if the directory was removed and created again
    since (its lock file is another file now: the old descriptors point at deleted segments)."""
    key = os.path.realpath(directory)
    with _ALLOCATORS_LOCK:
        alloc = _ALLOCATORS.get(key)
        if alloc is not None and not alloc.current():
            alloc.close()
            alloc = None
        if alloc is None:
            alloc = _ALLOCATORS[key] = _Allocator(directory, fsync)
        return alloc


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file at ``path`` (not a deleted one the path no longer names)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


class _RegionReader:
    """The part of ``BinaryIO`` the store's readers use (``readinto``, ``read``, ``with``), over one region."""

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        self._fd, self._start, self._end, self._pos = fd, offset, offset + nbytes, offset

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        want = min(len(view), self._end - self._pos)
        got = 0
        while got < want:
            n = os.preadv(self._fd, [view[got:want]], self._pos + got)
            if n == 0:
                break
            got += n
        self._pos += got
        return got

    def read(self, size: int = -1) -> bytes:
        left = self._end - self._pos
        n = left if size is None or size < 0 else min(size, left)
        data = os.pread(self._fd, n, self._pos)  # one copy, into the bytes returned
        if len(data) < n:  # a short read (signals): finish it
            rest = bytearray(n - len(data))
            data += bytes(memoryview(rest)[:self.readinto_at(rest, self._pos + len(data))])
        self._pos += len(data)
        return data

    def readinto_at(self, buf: bytearray, pos: int) -> int:
        got = 0
        while got < len(buf):
            n = os.preadv(self._fd, [memoryview(buf)[got:]], pos + got)
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        pass

    def __enter__(self) -> "_RegionReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _RegionSink(BlobSink):
    """Writes one blob into a region allocated at the size hint (or, without one, at ``close``)."""

    def __init__(self, writer: "_ArenaWriter", name: str) -> None:
        self._writer, self._name = writer, name
        self._region: Region | None = None
        self._buffered: bytearray | None = None
        self._written = 0

    def expect(self, nbytes: int | None) -> None:
        if self._region is None and self._buffered is None and nbytes is not None:
            self._region = self._writer.allocate(nbytes)

    def write(self, buf: Any) -> None:
        view = memoryview(buf).cast("B")
        if self._region is None:
            if self._buffered is None:
                self._buffered = bytearray()
            self._buffered += view
        else:
            seg, off, n = self._region
            if self._written + len(view) > n:
                raise ValueError(f"blob {self._name!r}: {self._written + len(view)} bytes written, {n} announced")
            alloc = self._writer.alloc
            # the payload (writable memory of tensors) is copied into the segment's mapping: ~2.5x less CPU
            # than pwrite(2) into tmpfs (docs/store.md, "The arena"); headers and trailers are pwritten
            base = None if view.readonly or not view else alloc.address(seg)
            if base is None:
                _pwrite_all(alloc.fds[seg], view, off + self._written)
            else:
                ctypes.memmove(base + off + self._written, ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view))
        self._written += len(view)
        self._writer.backend._hook("blob_write", self._writer.iteration, self._name)

    def close(self) -> None:
        if self._region is None:
            data = self._buffered or bytearray()
            self._region = self._writer.allocate(len(data))
            seg, off, _ = self._region
            _pwrite_all(self._writer.alloc.fds[seg], data, off)
            self._buffered = None
        seg, off, _ = self._region
        if self._writer.backend.fsync:
            os.fsync(self._writer.alloc.fds[seg])
        self._writer.closed(self._name, (seg, off, self._written))
        self._writer.backend._hook("blob_closed", self._writer.iteration, self._name)


class _ArenaWriter(PointWriter):
    _tokens = itertools.count()

    def __init__(self, backend: "ArenaBackend", iteration: int) -> None:
        self.backend, self.iteration = backend, iteration
        self.alloc = backend._writer_allocator()
        self.token = next(self._tokens)
        self.marker = backend.staging_dir / f"{iteration:012d}.{os.getpid()}.{self.token}"
        self.marker.touch(exist_ok=False)
        self.alloc.open(self.token)
        self.blobs: dict[str, Region] = {}
        self._lock = threading.Lock()
        self._done = False
        backend._open[self.marker.name] = self

    def allocate(self, nbytes: int) -> Region:
        return self.alloc.allocate(nbytes, self.token)

    def closed(self, name: str, region: Region) -> None:
        with self._lock:
            if name in self.blobs:
                raise ValueError(f"blob {name!r} written twice in point {self.iteration}")
            self.blobs[name] = region

    def open_blob(self, name: str) -> BlobSink:
        self._check_open(name)
        return _RegionSink(self, name)

    def map_blobs(self, blobs: list[tuple[str, int]]) -> list[tuple[torch.Tensor, int, int]]:
        self._check_open()
        for name, _ in blobs:
            if valid_blob_name(name) == MANIFEST:
                raise ValueError(f"blob name {MANIFEST!r} is reserved for the manifest")
        regions = self.alloc.allocate_many([nbytes for _, nbytes in blobs], self.token)
        for (name, _), region in zip(blobs, regions):  # a name refused here: its region is freed with the point
            self.closed(name, region)
        return [(self.alloc.mapping(seg), off, nbytes) for seg, off, nbytes in regions]

    def mapped_done(self, name: str) -> None:
        if self.backend.fsync:
            seg = self.blobs[name][0]
            os.fsync(self.alloc.fds[seg])
        self.backend._hook("blob_closed", self.iteration, name)

    def hand_over(self, rooms: dict[str, int]) -> tuple[dict[str, Region], dict[str, Region]]:
        """Publishing by another process (``moe_ft/store/handoff.py``): the point's regions, and a region of
        ``rooms[name]`` bytes for each blob that process writes (the manifest, the metadata entry)."""
        self._check_open()
        regions = dict(zip(rooms, self.alloc.allocate_many(list(rooms.values()), self.token)))
        with self._lock:
            return dict(self.blobs), regions

    def order_marker(self) -> str:
        return self.marker.name

    def withdraw(self) -> str | int:
        """The publisher did not answer: take the order back (``moe_ft/store/order_claim.py``). Returns
        ``order_claim.WITHDRAWN`` or ``FINISHED`` (no agent writes the regions any more), else the pid of the
        agent that holds it (then :meth:`doubt`)."""
        return order_claim.withdraw(self.backend.staging_dir, self.marker.name)

    def doubt(self) -> None:
        """An agent still holds the order: the regions stay allocated until it lets go (``_Allocator.settle``)."""
        self._done = True
        self.alloc.doubt(self.token, self.iteration, self.marker.name)
        self.backend._open.pop(self.marker.name, None)

    def handed_over(self, written: dict[str, Region]) -> None:
        """The other process linked the point's index, with the blobs it wrote at the start of the regions
        :meth:`hand_over` gave (``written``: where, how long): the regions are the point's."""
        with self._lock:
            blobs = [*self.blobs.values(), *written.values()]
        self._done = True
        self.alloc.published(self.token, self.iteration, blobs)
        self._forget()

    def commit(self, manifest: bytes) -> None:
        backend = self.backend
        self._check_open()
        sink = _RegionSink(self, MANIFEST)
        sink.expect(len(manifest))
        sink.write(manifest)
        sink.close()
        backend._hook("before_commit", self.iteration, "")
        with self._lock:
            blobs = dict(self.blobs)
        _write_index(backend.points_dir, self.iteration, blobs, replace=False, fsync=backend.fsync)
        self._done = True
        self.alloc.published(self.token, self.iteration, list(blobs.values()))
        self._forget()
        backend._hook("after_commit", self.iteration, "")

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.alloc.abort(self.token)
            self._forget()

    def _forget(self) -> None:
        self.backend._open.pop(self.marker.name, None)
        with contextlib.suppress(FileNotFoundError):
            self.marker.unlink()


class ArenaBackend(StoreBackend):
    """Arena store rooted at ``directory`` (created if missing; see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False, fault_hook: FaultHook | None = None,
                 create: bool = True, initial_bytes: int = 0) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self._fault_hook = fault_hook
        self.points_dir = self.directory / "points"
        self.staging_dir = self.directory / "staging"
        self.arena_dir = self.directory / "arena"
        self.pins_dir = self.directory / "pins"
        self.initial_bytes = initial_bytes
        self._open: dict[str, _ArenaWriter] = {}
        self._alloc: _Allocator | None = None
        self._read_fds: dict[int, int] = {}
        self._read_lock = threading.Lock()
        self._index_cache: dict[int, tuple[tuple[int, int], dict[str, Region]]] = {}
        self._cache_swept = 0  # entries of _index_cache after its last sweep (_forget_gone)
        found = format_file(self.directory, FORMAT, (self.points_dir, self.staging_dir, self.arena_dir), create)
        if found != FORMAT:
            raise StoreError(f"{self.directory / FORMAT_FILE}: store format {found} is not an arena store "
                             f"({FORMAT}); open it with moe_ft.store.open_backend, which reads either layout")

    # -- writing -----------------------------------------------------------------------------------------
    def _writer_allocator(self) -> _Allocator:
        if self._alloc is None or not self._alloc.current():
            self._alloc = _allocator(self.directory, self.fsync)
            self._alloc.pinned = self.pinned_elsewhere
            if self.initial_bytes and self._alloc.arena_bytes() < self.initial_bytes:
                with self._alloc.lock:
                    self._alloc._grow(self.initial_bytes - self._alloc.arena_bytes())
        return self._alloc

    def release_writer(self) -> bool:
        """Give up this process's writer of the directory (its lock and descriptors; a later write here takes
        them again) so that another process may write it: a replica store whose owner a new placement gave to
        a rank in another process on this node. ``False``, and nothing released, while a point is still being
        written into it."""
        key = os.path.realpath(self.directory)
        with _ALLOCATORS_LOCK:
            alloc = _ALLOCATORS.get(key)
            if alloc is not None:
                with alloc.lock:
                    if alloc.open_tokens:
                        return False
                    alloc.close()
                del _ALLOCATORS[key]
        self._alloc = None
        return True

    maps_regions = True

    def mapped_segments(self) -> dict[int, torch.Tensor]:
        """This process's writable mappings of the arena's segments (every segment mapped: the snapshot
        engine page-locks them once for device copies)."""
        alloc = self._writer_allocator()
        with alloc.lock:
            for seg in alloc.sizes:
                alloc.mapping(seg)
            return dict(alloc.maps)

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena's segments (what the store holds on its file system, indexes aside)."""
        return sum(os.stat(self.arena_dir / n).st_size for n in os.listdir(self.arena_dir) if n.isdigit())

    def _hook(self, phase: str, iteration: int, name: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase, iteration, name)

    def describe(self) -> str:
        return str(self.directory)

    def begin_point(self, iteration: int) -> PointWriter:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        return _ArenaWriter(self, iteration)

    def add_blob(self, iteration: int, name: str, data: bytes) -> None:
        if valid_blob_name(name) == MANIFEST:
            raise ValueError(f"blob name {MANIFEST!r} is reserved for the manifest")
        alloc = self._writer_allocator()
        with alloc.lock:  # read, extend and replace the index without another writer in between
            blobs = self._index(iteration)
            if blobs is None:
                raise FileNotFoundError(f"point {iteration} is not published in {self.directory}")
            if name in blobs:
                raise FileExistsError(f"{self.directory} point {iteration} already holds {name}")
            token = next(_ArenaWriter._tokens)
            alloc.open(token)
            region = alloc.allocate(len(data), token)
            try:
                _pwrite_all(alloc.fds[region[0]], data, region[1])
                if self.fsync:
                    os.fsync(alloc.fds[region[0]])
                _write_index(self.points_dir, iteration, {**blobs, name: region}, replace=True, fsync=self.fsync)
            except BaseException:
                alloc.abort(token)
                raise
            alloc.published(token, iteration, [region])

    def delete_point(self, iteration: int) -> None:
        index = self.points_dir / f"{iteration:012d}.json"
        alloc = self._alloc or _ALLOCATORS.get(os.path.realpath(self.directory))
        if alloc is not None and alloc.current():
            alloc.delete(index, iteration, self.pinned_elsewhere)
        else:  # not the allocating process: hide the point; the allocator reclaims its regions
            with contextlib.suppress(FileNotFoundError):
                os.unlink(index)
        self._index_cache.pop(iteration, None)

    def sweep_staging(self) -> int:
        removed = 0
        for info in self.list_staging():
            if info.label in self._open or (info.live and info.writer_pid != os.getpid()):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.staging_dir / info.label)
            removed += 1
        for name in os.listdir(self.staging_dir) if self.staging_dir.exists() else ():
            parts = name.split(".")  # an agent's claim of an order (moe_ft/store/order_claim.py), both sides gone
            if len(parts) == 4 and all(p.isdigit() for p in parts) and not any(
                    pid_alive(int(p)) for p in (parts[1], parts[3])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.staging_dir / name)
        for name in os.listdir(self.points_dir) if self.points_dir.exists() else ():
            if name.startswith(".") and name.endswith(".tmp") and not pid_alive(int(name.split(".")[2])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.points_dir / name)
        return removed

    # -- reading -----------------------------------------------------------------------------------------
    def list_points(self) -> list[int]:
        try:
            names = os.listdir(self.points_dir)
        except FileNotFoundError:
            names = []
        points = sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())
        self._forget_gone(points)
        return points

    def _forget_gone(self, listed: list[int] | None = None) -> None:
        """Drop the cached indexes of points that are gone (not in ``listed``, else whose index file is
        missing). A long-lived reader (the node agent's, per rank) reads each point once while another process
        deletes them: entries dropped only when the same point is asked for again would grow without end."""
        known = list(self._index_cache)  # one copy: other threads read and fill the cache meanwhile
        kept = set(listed) if listed is not None else {it for it in known if self.has_point(it)}
        for iteration in known:
            if iteration not in kept:
                self._index_cache.pop(iteration, None)
        self._cache_swept = len(self._index_cache)

    def has_point(self, iteration: int) -> bool:
        return os.path.exists(self.points_dir / f"{iteration:012d}.json")  # one stat, not a listing

    def list_staging(self) -> list[StagingInfo]:
        result = []
        try:
            names = sorted(os.listdir(self.staging_dir))
        except FileNotFoundError:
            return []
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            pid = int(parts[1])
            writer = self._open.get(name)
            nbytes = writer.alloc.allocated(writer.token) if writer is not None else 0
            result.append(StagingInfo(int(parts[0]), name, nbytes, pid, pid_alive(pid)))
        return result

    def _index(self, iteration: int) -> dict[str, Region] | None:
        path = self.points_dir / f"{iteration:012d}.json"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._index_cache.pop(iteration, None)
            return None
        stamp = (st.st_ino, st.st_mtime_ns)
        cached = self._index_cache.get(iteration)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        blobs = _read_index(path)
        if blobs is None:
            return {} if path.exists() else None  # damaged index: a point that holds nothing readable
        self._index_cache[iteration] = (stamp, blobs)
        if len(self._index_cache) > max(2 * self._cache_swept, _INDEX_CACHE_SWEEP):
            self._forget_gone()  # a stat per cached point each time the cache doubled: amortised O(1) per point
        return blobs

    def blob_location(self, iteration: int, name: str) -> tuple[str, int, int]:
        blobs = self._index(iteration)
        if blobs is None or name not in blobs:
            raise FileNotFoundError(f"{self.directory} point {iteration} has no blob {name}")
        seg, off, n = blobs[name]
        return str(self.arena_dir / f"{seg:04d}"), off, n

    def blob_names(self, iteration: int) -> list[str]:
        blobs = self._index(iteration)
        if blobs is None:
            raise FileNotFoundError(f"point {iteration} is not published in {self.directory}")
        return sorted(blobs)

    def blob_size(self, iteration: int, name: str) -> int | None:
        blobs = self._index(iteration)
        region = None if blobs is None else blobs.get(valid_blob_name(name))
        return None if region is None else region[2]

    def _fd(self, seg: int) -> int:
        """A descriptor of segment ``seg`` as the directory holds it now. A reader lives as long as its process
        (the node agent keeps one per rank): when the directory was removed and created again since (an elastic
        shrink and grow, a rerun), a cached descriptor would read the deleted file's bytes, so it is checked
        against the path's inode (an open file's inode number cannot be reused while the descriptor holds it)."""
        if self._alloc is not None and seg in self._alloc.fds and self._alloc.current():
            return self._alloc.fds[seg]
        path = self.arena_dir / f"{seg:04d}"
        with self._read_lock:
            fd = self._read_fds.get(seg)
            if fd is not None and not _same_file(fd, path):
                os.close(self._read_fds.pop(seg))
                fd = None
            if fd is None:
                fd = self._read_fds[seg] = os.open(path, os.O_RDONLY)
            return fd

    def open_blob(self, iteration: int, name: str) -> BinaryIO:
        blobs = self._index(iteration)
        region = None if blobs is None else blobs.get(valid_blob_name(name))
        if region is None:
            raise FileNotFoundError(f"{self.directory} point {iteration} has no blob {name}")
        seg, off, n = region
        try:
            fd = self._fd(seg)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.directory}: arena segment {seg} of point {iteration} is missing") from None
        return _RegionReader(fd, off, n)  # type: ignore[return-value]  # the part of BinaryIO readers use

    def close(self) -> None:
        """Close this object's read descriptors (the allocator's stay open for the process)."""
        with self._read_lock:
            for fd in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()
