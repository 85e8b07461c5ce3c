"""Node-local file backend: one directory per rank, normally on tmpfs (``/dev/shm``) so that snapshots
survive the death of the worker process (not of the node). Layout (see ``docs/store.md``)::
    <dir>/FORMAT.json                   {"format": "moe-ft-store", "version": 1}
    <dir>/points/<iteration:012d>/      published points: MANIFEST.json + one file per entry
    <dir>/staging/<iteration:012d>.<pid>.<n>/   points being written (or left by a killed writer)
    <dir>/trash/...                     points being deleted
    <dir>/recycle/<size>.<n>            entry files of deleted points, by exact size; the next entry of
                                        that size is written over one (tmpfs pages reused, not freed and
                                        allocated again)

Publishing a point is one ``rename(2)`` of its staging directory into ``points/``: atomic on POSIX file
systems, so a reader sees either the whole point or nothing. With ``fsync=True`` every file, the staging
directory and ``points/`` are fsynced around the rename (needed only on disks: tmpfs cannot lose data
that a process wrote, and does not survive a reboot anyway).

Recycling (``recycle=True``, see ``docs/store.md``): deleting a point moves its entry files into
``recycle/``, named by their size; an entry whose size equals a pooled file's (the store passes each
entry's exact size before writing it, :meth:`BlobSink.expect`) is written *over* that file in its staging
directory. On tmpfs a new file costs a page allocation and zeroing per 4 KiB before the copy, about as much
again as the copy (measured: 38 ms against 20 ms per 100 MB here); snapshots write entries of the same few
sizes every iteration (an operator's FULL and COMPUTE entries never change size; the experts of a layer
share theirs). The pool is bounded by the most bytes that were deleted between two consecutive points
(one round of garbage collection), oldest files freed first, so it holds at most what the next round of
points needs and tmpfs use exceeds that of a store without recycling by at most one such round. Files
found in ``recycle/`` when the backend opens (a previous process's pool) are freed. Publishing is
unchanged (write, then one rename).
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import os
import shutil
import threading
from pathlib import Path
from typing import Any, BinaryIO

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

FORMAT = {"format": "moe-ft-store", "version": 1}
FORMAT_FILE = "FORMAT.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecyclePool:
    """Entry files of deleted points in ``directory``, by exact size, oldest first (see the module
    docstring). Thread-safe: a point's entries may be written from several threads."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)  # a previous process's pool: its bound is unknown
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, int] = {}  # pooled file name -> size, in insertion order (oldest first)
        self._by_size: dict[int, list[str]] = {}
        self._counter = itertools.count()
        self.bytes = 0
        """Bytes in the pool now."""
        self.limit = 0
        """The most bytes deleted between two consecutive points so far: the pool's bound."""
        self._freed = 0
        self.reused = 0
        """Entries written over a pooled file (for tests and benchmarks)."""

    def new_point(self) -> None:
        with self._lock:
            self._freed = 0

    def add(self, path: str, size: int) -> None:
        """Move ``path`` (a file of a point being deleted, ``size`` bytes) into the pool."""
        name = f"{size}.{next(self._counter)}"
        os.rename(path, f"{self.directory}/{name}")
        with self._lock:
            self._files[name] = size
            self._by_size.setdefault(size, []).append(name)
            self.bytes += size
            self._freed += size
            self.limit = max(self.limit, self._freed)
            doomed = []
            while self.bytes > self.limit:
                old = next(iter(self._files))
                self._drop(old)
                doomed.append(old)
        for old in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self.directory}/{old}")

    def take(self, size: int, path: str) -> bool:
        """Move a pooled file of exactly ``size`` bytes to ``path``; ``False`` if the pool has none."""
        with self._lock:
            names = self._by_size.get(size)
            if not names:
                return False
            name = names[-1]  # the newest: most likely still in cache
            self._drop(name)
        try:
            os.rename(f"{self.directory}/{name}", path)
        except FileNotFoundError:  # removed behind our back (another process opened this store): a new file
            return False
        with self._lock:
            self.reused += 1
        return True

    def _drop(self, name: str) -> None:
        size = self._files.pop(name)
        names = self._by_size[size]
        names.remove(name)
        if not names:
            del self._by_size[size]
        self.bytes -= size


class _FileSink(BlobSink):
    """Writes one entry file; opened at the size hint (a pooled file of that size is written over) or at
    the first write."""

    def __init__(self, writer: "_LocalWriter", name: str) -> None:
        self._writer, self._name = writer, name
        self._path = f"{writer.path}/{name}"
        self._file: io.FileIO | None = None
        self._reused = False
        self._written = 0

    def expect(self, nbytes: int | None) -> None:
        if self._file is None:
            pool = self._writer.backend._pool
            self._reused = pool is not None and nbytes is not None and pool.take(nbytes, self._path)
            self._file = open(self._path, "r+b" if self._reused else "xb", buffering=0)

    def write(self, buf: Any) -> None:
        if self._file is None:
            self.expect(None)
        assert self._file is not None
        view = memoryview(buf).cast("B")
        self._written += len(view)
        while view:  # raw (unbuffered) writes may be short
            view = view[self._file.write(view):]
        self._writer.backend._hook("blob_write", self._writer.iteration, self._name)

    def close(self) -> None:
        if self._file is None:
            self.expect(None)
        assert self._file is not None
        if self._reused:  # the hint is a promise of the caller's: never leave stale bytes past the end
            self._file.truncate(self._written)
        if self._writer.backend.fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        self._writer.backend._hook("blob_closed", self._writer.iteration, self._name)


class _LocalWriter(PointWriter):
    def __init__(self, backend: "LocalFSBackend", iteration: int, path: Path) -> None:
        self.backend, self.iteration, self.path = backend, iteration, path
        self._done = False

    def open_blob(self, name: str) -> BlobSink:
        self._check_open(name)
        return _FileSink(self, name)

    def commit(self, manifest: bytes) -> None:
        backend = self.backend
        self._check_open()
        with open(self.path / MANIFEST, "xb") as f:
            f.write(manifest)
            if backend.fsync:
                os.fsync(f.fileno())
        if backend.fsync:
            _fsync_dir(self.path)
        backend._hook("before_commit", self.iteration, "")
        final = backend.points_dir / f"{self.iteration:012d}"
        try:
            os.rename(self.path, final)  # atomic; fails on a non-empty existing target
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"point {self.iteration} is already published at {final}") from None
            raise
        self._done = True
        backend._forget(self)
        if backend.fsync:
            _fsync_dir(backend.points_dir)
        backend._hook("after_commit", self.iteration, "")

    def abort(self) -> None:
        if not self._done:
            self._done = True
            shutil.rmtree(self.path, ignore_errors=True)
            self.backend._forget(self)


class LocalFSBackend(StoreBackend):
    """File backend rooted at ``directory`` (created if missing). One writing process per directory."""

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False,
                 fault_hook: FaultHook | None = None, create: bool = True, recycle: bool = False) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.recycle = recycle
        self._fault_hook = fault_hook
        self.points_dir = self.directory / "points"
        self._points_str = str(self.points_dir)
        self.staging_dir = self.directory / "staging"
        self.trash_dir = self.directory / "trash"
        self.pins_dir = self.directory / "pins"
        self._lock = threading.Lock()
        self._open: set[Path] = set()
        self._counter = itertools.count()
        found = format_file(self.directory, FORMAT, (self.points_dir, self.staging_dir, self.trash_dir), create)
        if found.get("format") != FORMAT["format"] or found.get("version") != FORMAT["version"]:
            raise StoreError(f"{self.directory / FORMAT_FILE}: unsupported store format {found}; this moe-ft "
                             f"reads {FORMAT}")
        self._pool = _RecyclePool(str(self.directory / "recycle")) if recycle else None

    @property
    def pool(self) -> "_RecyclePool | None":
        """The pool of recycled entry files (``recycle=True``), for its statistics; ``None`` otherwise."""
        return self._pool

    def _hook(self, phase: str, iteration: int, name: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase, iteration, name)

    def _forget(self, writer: _LocalWriter) -> None:
        with self._lock:
            self._open.discard(writer.path)

    def describe(self) -> str:
        return str(self.directory)

    def begin_point(self, iteration: int) -> PointWriter:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        path = self.staging_dir / f"{iteration:012d}.{os.getpid()}.{next(self._counter)}"
        path.mkdir(parents=True)
        if self._pool is not None:
            self._pool.new_point()
        with self._lock:
            self._open.add(path)
        return _LocalWriter(self, iteration, path)

    def list_points(self) -> list[int]:
        try:
            names = os.listdir(self.points_dir)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def list_staging(self) -> list[StagingInfo]:
        result = []
        try:
            entries = sorted(os.scandir(self.staging_dir), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        for entry in entries:
            parts = entry.name.split(".")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            try:
                nbytes = sum(f.stat().st_size for f in os.scandir(entry.path))
            except FileNotFoundError:  # committed or aborted while we looked
                continue
            pid = int(parts[1])
            result.append(StagingInfo(int(parts[0]), entry.name, nbytes, pid, pid_alive(pid)))
        return result

    def _point_path(self, iteration: int) -> str:
        # plain strings: pathlib's joins cost ~20 us each, and catalog()/GC stat every entry of every point
        return f"{self._points_str}/{iteration:012d}"

    def blob_names(self, iteration: int) -> list[str]:
        return sorted(os.listdir(self._point_path(iteration)))

    def blob_size(self, iteration: int, name: str) -> int | None:
        try:
            return os.stat(f"{self._point_path(iteration)}/{valid_blob_name(name)}").st_size
        except FileNotFoundError:
            return None

    def blob_location(self, iteration: int, name: str) -> tuple[str, int, int]:
        path = f"{self._point_path(iteration)}/{valid_blob_name(name)}"
        return path, 0, os.stat(path).st_size

    def open_blob(self, iteration: int, name: str) -> BinaryIO:
        return open(f"{self._point_path(iteration)}/{valid_blob_name(name)}", "rb")

    def add_blob(self, iteration: int, name: str, data: bytes) -> None:
        point = self._point_path(iteration)
        final = f"{point}/{valid_blob_name(name)}"
        if name == MANIFEST:
            raise ValueError(f"blob name {MANIFEST!r} is reserved for the manifest")
        if os.path.exists(final):
            raise FileExistsError(f"{final} exists")
        tmp = f"{point}/.{name}.{os.getpid()}.{next(self._counter)}"  # not listed: blob names never start with "."
        with open(tmp, "xb") as f:  # FileNotFoundError if the point is gone
            f.write(data)
            if self.fsync:
                os.fsync(f.fileno())
        try:
            os.link(tmp, final)  # atomic, and fails if the name exists (unlike rename)
        finally:
            os.unlink(tmp)
        if self.fsync:
            _fsync_dir(Path(point))

    def delete_point(self, iteration: int) -> None:
        target = self.trash_dir / f"{iteration:012d}.{os.getpid()}.{next(self._counter)}"
        self.trash_dir.mkdir(exist_ok=True)
        try:
            os.rename(self._point_path(iteration), target)  # invisible from here on
        except FileNotFoundError:
            return
        if self._pool is not None:
            with os.scandir(target) as entries:
                files = [(e.path, e.stat().st_size) for e in entries if e.name != MANIFEST and e.is_file()]
            for path, size in files:
                self._pool.add(path, size)
        shutil.rmtree(target, ignore_errors=True)

    def sweep_staging(self) -> int:
        removed = 0
        with self._lock:
            mine = set(self._open)
        for info in self.list_staging():
            path = self.staging_dir / info.label
            if path in mine or (info.live and info.writer_pid != os.getpid()):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        for entry in os.scandir(self.trash_dir) if self.trash_dir.exists() else ():
            shutil.rmtree(entry.path, ignore_errors=True)
        return removed
