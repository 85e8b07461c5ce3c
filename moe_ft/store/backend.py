"""The byte-level interface every store tier implements: node-local tmpfs (the arena or files), in-process
memory, the peer replicas a node holds (the node's layout) and the durable tier (files). A backend knows nothing about tensors, operators or checksums; it
stores *blobs* (opaque named byte strings) grouped into *points* (one per iteration) and guarantees:

1. **Atomic publish.** Blobs written through a :class:`PointWriter` are invisible until
   :meth:`PointWriter.commit` returns; a crash (or an exception, or ``abort``) before that leaves the
   published points untouched and nothing that looks published.
2. **Immutability.** A published point never changes until it is deleted; ``delete_point`` makes it
   invisible atomically before reclaiming space.
3. **Leftovers are visible as staging.** An interrupted writer's partial data is reported by
   :meth:`StoreBackend.list_staging` (for ``moe-ft inspect``) and removed by ``sweep_staging``.

The contract is pinned down by ``tests/test_store_contract.py``, which every backend must pass.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from moe_ft.store.errors import StoreError

FaultHook = Callable[[str, int, str], None]
"""Called as ``hook(phase, iteration, blob_name)`` at deterministic points of a write, for failure
injection (it may block, raise, or let the test kill the process). Phases, in order: ``"blob_write"`` after
each chunk of a blob reaches the backend, ``"blob_closed"``, ``"before_commit"`` (all blobs and the
manifest are written, the point is still invisible) and ``"after_commit"``."""

MANIFEST = "MANIFEST.json"
_PIN_TOKENS = itertools.count()


def dir_id(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(device, inode)`` of directory ``path``, ``None`` once it is gone: a store directory removed (and
    perhaps created again) is another one, whatever a process still holds open of the first."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (the writer of a staging point, the holder of a lock)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def format_file(directory: Path, fmt: dict, dirs: tuple[Path, ...], create: bool) -> dict:
    """Read the ``FORMAT.json`` of store ``directory``; without one, create the store (``dirs`` and the
    file, atomically) or, with ``create=False``, raise ``StoreError``. Returns what the file says."""
    path = directory / "FORMAT.json"
    if not path.exists():
        if not create:
            raise StoreError(f"{directory} is not a moe-ft store (no FORMAT.json); pass the per-rank "
                             f"directory, e.g. /dev/shm/moe_ft/<job>/rank0")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".FORMAT.json.{os.getpid()}"
        tmp.write_text(json.dumps(fmt))
        os.replace(tmp, path)
    return read_format(path)


def read_format(path: Path) -> dict:
    """What the ``FORMAT.json`` at ``path`` says (``FileNotFoundError`` when there is none): a JSON object,
    else ``StoreError`` naming the file. Valid JSON of another type (``"x"``, ``[1]``) is refused here too:
    every reader looks its fields up with ``.get``."""
    try:
        found = json.loads(path.read_text())
    except NotADirectoryError:  # the store directory named is a file
        raise StoreError(f"{path.parent} is a file, not a store directory; pass the per-rank directory, e.g. "
                         "/dev/shm/moe_ft/<job>/rank0") from None
    except ValueError as exc:  # UnicodeDecodeError is one too
        raise StoreError(f"{path} is unreadable ({exc}): not a moe-ft store, or a damaged one") from None
    if not isinstance(found, dict):
        raise StoreError(f"{path} holds a JSON {type(found).__name__}, not the store's format object "
                         '({"format": "moe-ft-store", "version": ...}): not a moe-ft store, or a damaged one')
    return found


def valid_blob_name(name: str) -> str:
    """``name`` if it can name a blob (a plain file name, not hidden), else ``ValueError``."""
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"invalid blob name {name!r}: must be a plain file name")
    return name


@dataclass(frozen=True)
class StagingInfo:
    """An unpublished point: being written now, or left behind by a writer that died."""

    iteration: int
    label: str  # backend-specific name (a directory for the file backend)
    nbytes: int
    writer_pid: int | None
    live: bool  # the writing process is still running


class BlobSink(abc.ABC):
    """Sequential writer of one blob. ``write`` accepts any buffer (bytes, memoryview over tensor memory)
    and must not keep a reference to it after returning, so that callers can reuse pinned buffers."""

    @abc.abstractmethod
    def write(self, buf: Any) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def expect(self, nbytes: int | None) -> None:
        """Size hint: the blob will be exactly ``nbytes`` long (called before the first ``write``, if at
        all; ``None``: unknown). Backends that preallocate or reuse storage use it; the base class needs
        nothing."""


class PointWriter(abc.ABC):
    """Staging area of one point. Blobs may be written from several threads at once (one sink each)."""

    iteration: int
    _done: bool = False

    def _check_open(self, name: str | None = None) -> None:
        """Raise unless the point is still being written and ``name`` (if given) can name an entry blob."""
        if self._done:
            raise RuntimeError(f"point {self.iteration} was already committed or aborted")
        if name is not None and valid_blob_name(name) == MANIFEST:
            raise ValueError(f"blob name {MANIFEST!r} is reserved for the manifest")

    @abc.abstractmethod
    def open_blob(self, name: str) -> BlobSink: ...

    def map_blob(self, name: str, nbytes: int) -> Any:
        """A writable ``uint8`` tensor over the ``nbytes`` the blob will hold, in the store's own memory (a
        mapped region), for a writer that fills it in place (a device-to-host copy) and then calls
        :meth:`mapped_done`. Only backends with ``maps_regions`` have regions to map; the others refuse."""
        mapping, offset, size = self.map_blobs([(name, nbytes)])[0]
        return mapping[offset:offset + size]

    def map_blobs(self, blobs: list[tuple[str, int]]) -> list[tuple[Any, int, int]]:
        """:meth:`map_blob` of several ``(name, nbytes)`` at once, each as ``(its segment's uint8 tensor, offset,
        nbytes)`` (no view made: a caller that copies by address needs none)."""
        raise ValueError(f"{type(self).__name__} keeps blobs in files it writes, not in regions it maps: "
                         "write them with open_blob, or use the arena layout (--ft-store-layout arena)")

    def mapped_done(self, name: str) -> None:
        """The blob from :meth:`map_blob` is filled (its bytes are final)."""

    def hand_over(self, rooms: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Publishing by another process (``moe_ft/store/handoff.py``): the point's regions and one of
        ``rooms[name]`` bytes for each blob it writes. Only backends with ``maps_regions`` have regions."""
        raise ValueError(f"{type(self).__name__} keeps blobs in files it writes: another process cannot publish "
                         "them (use the arena layout, --ft-store-layout arena)")

    def handed_over(self, written: dict[str, Any]) -> None:
        """The other process published the point from :meth:`hand_over`, the blobs it wrote at ``written``."""
        raise ValueError(f"{type(self).__name__} hands no point over")

    def order_marker(self) -> str:
        """The name the other process claims the point's order by (``moe_ft/store/order_claim.py``)."""
        raise ValueError(f"{type(self).__name__} hands no point over")

    def withdraw(self) -> str | int:
        """Take back an order the other process did not answer (``moe_ft/store/order_claim.py``)."""
        raise ValueError(f"{type(self).__name__} hands no point over")

    def doubt(self) -> None:
        """The other process still holds the order: keep the point's regions until it lets go."""
        raise ValueError(f"{type(self).__name__} hands no point over")

    @abc.abstractmethod
    def commit(self, manifest: bytes) -> None:
        """Store ``manifest`` as blob :data:`MANIFEST` and make the point visible, atomically. Raises
        :class:`FileExistsError` if a point with this iteration is already published."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; idempotent."""


class StoreBackend(abc.ABC):
    """Storage of points and blobs; see the module docstring for the guarantees."""

    maps_regions: bool = False
    """Whether writers can fill blobs in place (:meth:`PointWriter.map_blob`; the arena)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the data lives, for messages (e.g. a directory)."""

    @abc.abstractmethod
    def begin_point(self, iteration: int) -> PointWriter: ...

    @abc.abstractmethod
    def list_points(self) -> list[int]:
        """Iterations of published points, ascending."""

    def has_point(self, iteration: int) -> bool:
        """Whether point ``iteration`` is published."""
        return iteration in self.list_points()

    @abc.abstractmethod
    def list_staging(self) -> list[StagingInfo]: ...

    @abc.abstractmethod
    def blob_names(self, iteration: int) -> list[str]:
        """Blob names of a published point (including the manifest); raises ``FileNotFoundError``."""

    @abc.abstractmethod
    def blob_size(self, iteration: int, name: str) -> int | None:
        """Size of a published blob, ``None`` if it does not exist."""

    @abc.abstractmethod
    def open_blob(self, iteration: int, name: str) -> BinaryIO:
        """A binary stream supporting ``readinto``; raises ``FileNotFoundError``."""

    def read_blob(self, iteration: int, name: str) -> bytes:
        with self.open_blob(iteration, name) as stream:
            return stream.read()

    def blob_location(self, iteration: int, name: str) -> tuple[str, int, int]:
        """Where a published blob's bytes lie: (file, offset, length), for tools and failure injection
        that damage a blob in place. Raises ``FileNotFoundError``; backends without files raise
        ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no files")

    @abc.abstractmethod
    def add_blob(self, iteration: int, name: str, data: bytes) -> None:
        """Add blob ``name`` to published point ``iteration`` atomically (it appears whole or not at all);
        for entries the manifest already lists but the point does not hold yet (remote entries fetched
        from replica peers). Raises ``FileNotFoundError`` if the point is gone, ``FileExistsError`` if the
        blob exists."""

    @abc.abstractmethod
    def delete_point(self, iteration: int) -> None:
        """Make a published point invisible (atomically), then reclaim it. Missing points are ignored."""

    pins_dir: Path | None = None
    """Where other processes pin points (:meth:`pin_elsewhere`); ``None``: a backend no other process reads."""

    @contextlib.contextmanager
    def pin_elsewhere(self, iterations: Iterable[int]) -> Iterator[None]:
        """Keep ``iterations`` from the writing process's garbage collection while the block runs: for a
        reader in another process (the node agent copying a point to the durable tier). One file per point
        in :attr:`pins_dir`, named with the reader's pid (a pin of a dead reader does not count)."""
        if self.pins_dir is None:
            yield
            return
        self.pins_dir.mkdir(parents=True, exist_ok=True)
        token = next(_PIN_TOKENS)
        paths = [self.pins_dir / f"{it:012d}.{os.getpid()}.{token}" for it in iterations]
        try:
            for path in paths:
                path.touch()
            yield
        finally:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def pinned_elsewhere(self) -> set[int]:
        """Iterations that live processes pinned with :meth:`pin_elsewhere`. The pins of dead readers (an agent
        killed while it read) are removed on the way: left in place, they would count again once the pid is
        given to another process, and keep their points from garbage collection for good."""
        try:
            names = os.listdir(self.pins_dir) if self.pins_dir is not None else []
        except FileNotFoundError:
            return set()
        out = set()
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            if pid_alive(int(parts[1])):
                out.add(int(parts[0]))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.pins_dir / name)  # type: ignore[operator]
        return out

    @abc.abstractmethod
    def sweep_staging(self) -> int:
        """Remove staging left behind by writers that are no longer running; returns how many."""
