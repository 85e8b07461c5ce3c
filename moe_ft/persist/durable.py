"""The durable tier (MoC §5.1 two-level persistence): recovery points copied from the node-local store
to durable storage (``--ft-persist-dir``, default ``--save``), in the store's own entry format.

Layout::

    <persist_dir>/moe_ft/<job_id>/
      rank<r>/points/<iteration>/...        LocalFSBackend (fsync on): the entries a recovery point needs
      rank<r>/done/<end>.json               this rank's part of the point ending at <end> is durable
      complete/<end>.json                   every rank's part is durable: the point is usable

A point is *complete* only when ``complete/<end>.json`` exists; the rank that finds every rank's
``done`` marker (of this world size) writes it (write to a temporary file, fsync, rename — atomic, idempotent). Retention keeps
the newest ``keep`` complete points and whatever a newer, still incomplete point uses; it never deletes
the newest complete point.

Both markers record the world size that wrote them: a job relaunched on more or fewer ranks splits its
state differently, so a point of another world size is not complete for it (and is dropped once this world
has a newer complete point, whose retention deletes the older point's entries anyway). Markers written
before the world size was recorded count for the world whose ranks their parts cover exactly.

Ranks (on different nodes) run their retention passes concurrently, and any of them may drop old
``complete`` markers: every read of a marker tolerates the marker vanishing between the listing and the
read (a vanished point is simply no longer kept).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import LocalFSBackend, SnapshotStore
from moe_ft.store.rules import EntryRef, RecoveryPoint

log = logging.getLogger("moe_ft.persist")
_MARKER = re.compile(r"\d{12}\.json")
"""A marker's name; anything else in ``complete/`` or ``done/`` (a README, an editor's backup) is not ours."""


def _marker_ends(folder: Path) -> list[int]:
    """Ends of the markers in ``folder``, ascending; a folder that cannot be listed is one clear error."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RuntimeError(f"moe-ft durable tier: cannot list {folder}: {e.strerror or e}") from None
    return sorted(int(n[:-5]) for n in names if _MARKER.fullmatch(n))


def _atomic_write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid and thread: the node agent writes markers of several ranks from one process at once
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full directory: the marker is written whole or not at all, and no stray file stays
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_to_json(point: RecoveryPoint) -> dict:
    return {"start": point.start, "end": point.end,
            "full_at": {str(op): it for op, it in point.full_at.items()},
            "entries": [[e.iteration, None if e.op is None else str(e.op), None if e.level is None else e.level.name]
                        for e in point.entries]}


def point_from_json(data: dict) -> RecoveryPoint:
    entries = tuple(EntryRef(it, None if op is None else OperatorId.parse(op), None if lvl is None else Level[lvl])
                    for it, op, lvl in data["entries"])
    return RecoveryPoint(data["start"], data["end"], {OperatorId.parse(k): v for k, v in data["full_at"].items()},
                         entries)


@dataclass(frozen=True)
class CompletePoint:
    """A durable recovery point every rank finished: ``parts[rank]`` is that rank's :class:`RecoveryPoint`."""

    end: int
    parts: dict[int, RecoveryPoint]
    world_size: int | None
    """The world size that wrote it (``None``: an unrecorded one, see the module docstring)."""


def _marker_world(data: dict) -> int | None:
    if "world_size" in data:
        return int(data["world_size"])
    # written before the world size was recorded: parts covering exactly ranks 0..n-1 tell it
    ranks = {int(r) for r in data.get("parts", {})}
    return len(ranks) if ranks == set(range(len(ranks))) and ranks else None


class DurableTier:
    """Reads and writes the layout above for a job of ``world_size`` ranks."""

    def __init__(self, persist_dir: str | os.PathLike, job_id: str, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.root = Path(persist_dir)
        """The tier's root (``--ft-persist-dir`` or ``--save``)."""
        self.directory = self.root / "moe_ft" / job_id
        self.world_size = world_size
        self._reported: set[int] = set()  # other-world points already reported (one line each)

    def of_world(self, world_size: int) -> "DurableTier":
        """The same directory for a job of ``world_size`` ranks; a point already reported is not again."""
        tier = DurableTier(self.root, self.directory.name, world_size)
        tier._reported = self._reported
        return tier

    def store(self, rank: int) -> SnapshotStore:
        """Rank ``rank``'s durable entries, read and written through the usual verified store."""
        return SnapshotStore(LocalFSBackend(self.directory / f"rank{rank}", fsync=True))

    def reader(self, rank: int) -> SnapshotStore:
        """Rank ``rank``'s durable entries, opened read-only: nothing is created (``StoreError`` when the rank's
        directory is no store: missing, or without its ``FORMAT.json``)."""
        return SnapshotStore(LocalFSBackend(self.directory / f"rank{rank}", create=False))

    def _done(self, rank: int, end: int) -> Path:
        return self.directory / f"rank{rank}" / "done" / f"{end:012d}.json"

    def mark_done(self, rank: int, point: RecoveryPoint) -> bool:
        """Record that ``rank``'s part of ``point`` is durable; returns whether the point became complete."""
        _atomic_write(self._done(rank, point.end), {**point_to_json(point), "world_size": self.world_size})
        parts = {}
        for r in range(self.world_size):
            try:  # rank r's retention drops its markers of superseded points at any time
                data = json.loads(self._done(r, point.end).read_text())
            except FileNotFoundError:
                return False
            if data.pop("world_size", None) != self.world_size:  # left by a run of another world size
                return False
            parts[str(r)] = data
        _atomic_write(self.directory / "complete" / f"{point.end:012d}.json",
                      {"end": point.end, "world_size": self.world_size, "parts": parts})
        return True

    def _markers(self) -> list[tuple[int, int | None]]:
        """``(end, world size)`` of every complete marker, of any world size, ascending."""
        folder = self.directory / "complete"
        out = []
        for end in _marker_ends(folder):
            try:
                data = json.loads((folder / f"{end:012d}.json").read_text())
            except FileNotFoundError:  # dropped by another rank's retention since the listing
                continue
            except (OSError, ValueError) as e:  # markers are written atomically: this one was damaged since
                self._report(end, f"unreadable marker {folder / f'{end:012d}.json'} ({e})")
                continue
            if not isinstance(data, dict) or not isinstance(data.get("parts"), dict):
                self._report(end, f"malformed marker {folder / f'{end:012d}.json'}")
                continue
            out.append((end, _marker_world(data)))
        return out

    def _report(self, end: int, why: str) -> None:
        if end not in self._reported:
            self._reported.add(end)
            log.warning("moe-ft durable tier: ignoring the complete point ending at %d: %s", end, why)

    def recorded_points(self) -> list[int]:
        """Ends of the complete points of every world size (``moe-ft inspect``), ascending."""
        return [end for end, _ in self._markers()]

    def complete_points(self) -> list[int]:
        """Ends of the complete durable points of this world size, ascending; a point of another world size
        is reported (once) and skipped."""
        ends = []
        for end, world in self._markers():
            if world == self.world_size:
                ends.append(end)
            else:
                self._report(end, f"in {self.directory}, written by {'an unknown number of' if world is None else world} "
                                  f"ranks, this job has {self.world_size} rank{'s' if self.world_size > 1 else ''}")
        return ends

    def newer_other_world(self, newer_than: int) -> CompletePoint | None:
        """The newest complete point of another world size (or an unknown one) that is newer than
        ``newer_than`` and than every complete point of this world size, or ``None``: what a start of this
        world size could not recover from, and whose entries its retention would delete."""
        markers = self._markers()
        own = max((end for end, world in markers if world == self.world_size), default=-1)
        for end, world in reversed(markers):
            if end <= max(newer_than, own):
                return None
            if world != self.world_size and (point := self._complete_or_none(end)) is not None:
                return point
        return None

    def _parts_of(self, rank: int, ends) -> set[int]:
        """The iterations ``rank``'s parts of the complete points ending at ``ends`` use (a point another
        rank's retention just dropped uses none)."""
        needed: set[int] = set()
        for end in ends:
            if (point := self._complete_or_none(end)) is not None and rank in point.parts:
                needed.update(point.parts[rank].iterations)
        return needed

    def complete(self, end: int) -> CompletePoint:
        data = json.loads((self.directory / "complete" / f"{end:012d}.json").read_text())
        return CompletePoint(end, {int(r): point_from_json(p) for r, p in data["parts"].items()}, _marker_world(data))

    def _complete_or_none(self, end: int) -> CompletePoint | None:
        """The complete point ending at ``end``, or ``None`` if another rank's retention just dropped it."""
        try:
            return self.complete(end)
        except FileNotFoundError:
            return None

    def newest_complete(self) -> CompletePoint | None:
        for end in reversed(self.complete_points()):
            if (point := self._complete_or_none(end)) is not None:
                return point
        return None

    def unmark(self, rank: int, iteration: int) -> list[int]:
        """``rank`` is about to replace its durable ``iteration`` (another run's or timeline's bytes): the
        complete points whose part of ``rank`` uses it are no longer complete, nor are every rank's done markers
        of them (the last rank to flush would mark the point complete again from the others' old ones), nor
        ``rank``'s own done markers that use it. Dropped first, so that no recovery takes a point whose ranks'
        parts come from two timelines while the ranks rewrite theirs one by one (each rank's next flush marks
        its part done again, the last one the point complete). Returns the ends."""
        dropped = []
        for end in self.recorded_points():  # another world's point too: its rank ``rank`` is this directory
            point = self._complete_or_none(end)
            if point is None or (part := point.parts.get(rank)) is None:
                continue
            if iteration in part.iterations:
                (self.directory / "complete" / f"{end:012d}.json").unlink(missing_ok=True)
                for r in range(max(self.world_size, len(point.parts))):
                    self._done(r, end).unlink(missing_ok=True)
                dropped.append(end)
        for end in self.done_points(rank):
            part = self._done_part(rank, end)
            if part is not None and iteration in part.iterations:
                self._done(rank, end).unlink(missing_ok=True)
        return dropped

    def done_points(self, rank: int) -> list[int]:
        return _marker_ends(self.directory / f"rank{rank}" / "done")

    def _done_part(self, rank: int, end: int) -> RecoveryPoint | None:
        try:  # this rank's in-process writer and the runtime's discard_after may both drop its markers
            return point_from_json(json.loads(self._done(rank, end).read_text()))
        except FileNotFoundError:
            return None

    def gc(self, rank: int, keep: int) -> list[int]:
        """Delete ``rank``'s durable entries no kept point needs: the newest ``keep`` (>= 1) complete points
        and any newer point still in flight. Returns the deleted iterations."""
        ends = self.complete_points()
        if not ends:
            return []
        kept_ends = ends[-max(1, keep):]
        newest = kept_ends[-1]
        needed: set[int] = set()
        for end in kept_ends:
            # a marker another rank dropped meanwhile is not kept: that rank saw newer complete points, whose
            # entries this rank's own done markers (newer than ``newest``, below) keep
            if (point := self._complete_or_none(end)) is not None and rank in point.parts:
                needed.update(point.parts[rank].iterations)
        for end in self.done_points(rank):
            if end > newest:  # in flight on other ranks
                if (part := self._done_part(rank, end)) is not None:
                    needed.update(part.iterations)
            elif end not in kept_ends:
                self._done(rank, end).unlink(missing_ok=True)
        store = self.store(rank)
        doomed = [it for it in store.points() if it not in needed and it < newest]
        for it in doomed:
            store.delete_point(it)
        for end in ends[:-max(1, keep)]:  # any rank may drop markers older than the kept points
            (self.directory / "complete" / f"{end:012d}.json").unlink(missing_ok=True)
        for end, world in self._markers():  # another world's points older than ours: their entries just went
            if world != self.world_size and end < newest:
                (self.directory / "complete" / f"{end:012d}.json").unlink(missing_ok=True)
        return doomed

    def discard_after(self, rank: int, iteration: int) -> list[int]:
        """After a rollback to ``iteration``: drop ``rank``'s durable points (and done markers) newer than it
        that no complete point uses — the abandoned timeline's partial flushes, which must not mix with the
        new timeline's (a lossy run re-executes differently). Complete points are never touched, those of
        another world size neither (an elastic reshape's new world: the old world's points stay until this
        world's retention supersedes them). Returns the deleted iterations."""
        complete = self.recorded_points()
        needed = self._parts_of(rank, complete)
        for end in self.done_points(rank):
            if end > iteration and end not in complete:
                self._done(rank, end).unlink(missing_ok=True)
        store = self.store(rank)
        doomed = [it for it in store.points() if it > iteration and it not in needed]
        for it in doomed:
            store.delete_point(it)
        return doomed
