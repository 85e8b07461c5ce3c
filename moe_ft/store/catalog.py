"""An immutable view of the published points of a store, built from their manifests, with the queries
recovery needs. Entries that failed a check are absent from the view and listed in ``problems``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.manifest import EntryRecord, PointRecord


@dataclass(frozen=True)
class Problem:
    """Something wrong with a point or entry: ``what`` is ``"point"`` (manifest), an entry name such as
    ``expert.L3.E7@FULL`` or ``meta``; ``reason`` says what failed."""

    iteration: int
    what: str
    reason: str

    def __str__(self) -> str:
        return f"iteration {self.iteration} {self.what}: {self.reason}"


class Catalog:
    def __init__(self, points: Mapping[int, PointRecord], problems: Iterable[Problem] = (),
                 holes: Iterable[tuple[int, OperatorId]] = (),
                 damaged: Iterable[tuple[int, OperatorId | None]] = ()) -> None:
        self._points = dict(sorted(points.items()))
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.holes: frozenset[tuple[int, OperatorId]] = frozenset(holes)
        """``(iteration, op)`` of remote FULL entries (:attr:`EntryRecord.remote`) whose file is not here
        (not fetched from the replica peers, or found damaged). They stay listed: the operator's state at
        that iteration exists, this store just cannot restore it, so a recovery rule must not fall back
        to an older FULL entry of the operator as if it were the newest (``NewestFullRule``)."""
        self.damaged: frozenset[tuple[int, OperatorId | None]] = frozenset(damaged)
        """``(iteration, op)`` of local FULL entries dropped because they failed a check (``op`` ``None``: the
        point's manifest, so any operator's entry there). Unlike the other
        dropped entries they matter beyond their own point: the operator was saved FULL there, so an older
        FULL entry of it is not its newest state (``NewestFullRule`` refuses the points that would restore
        one: the token loss would miss the tokens in between, and a data-parallel replica whose entry is
        intact would restore the newer one)."""

    @property
    def iterations(self) -> list[int]:
        """Iterations of the (readable) published points, ascending."""
        return list(self._points)

    def point(self, iteration: int) -> PointRecord | None:
        return self._points.get(iteration)

    def points(self) -> list[PointRecord]:
        return list(self._points.values())

    def level(self, iteration: int, op: OperatorId) -> Level:
        point = self._points.get(iteration)
        return Level.NONE if point is None else point.level(op)

    def has_meta(self, iteration: int) -> bool:
        point = self._points.get(iteration)
        return point is not None and point.meta is not None

    def operators(self) -> set[OperatorId]:
        return {op for p in self._points.values() for op in p.entries}

    def newest_full(self, op: OperatorId, at_or_before: int | None = None) -> int | None:
        """Iteration of the newest FULL entry of ``op`` at or before ``at_or_before`` (None: any)."""
        for it in reversed(self._points):
            if (at_or_before is None or it <= at_or_before) and self._points[it].level(op) == Level.FULL:
                return it
        return None

    def newest_full_map(self, ops: Iterable[OperatorId], at_or_before: int | None = None) -> dict[OperatorId, int | None]:
        return {op: self.newest_full(op, at_or_before) for op in ops}

    def newest_damaged(self, op: OperatorId, at_or_before: int) -> int | None:
        """Iteration of the newest FULL entry of ``op`` at or before ``at_or_before`` dropped as damaged (or of a
        point whose manifest was)."""
        return max((it for it, o in self.damaged if o in (op, None) and it <= at_or_before), default=None)

    def unavailable(self, iteration: int, op: OperatorId, *, local_only: bool = False) -> bool:
        """Whether ``op``'s entry at ``iteration`` cannot be restored from this store: a hole, or (with
        ``local_only``) any remote entry, fetched or not."""
        if (iteration, op) in self.holes:
            return True
        if not local_only:
            return False
        entry = self._points[iteration].entries.get(op) if iteration in self._points else None
        return entry is not None and entry.remote

    @property
    def has_remote(self) -> bool:
        return any(e.remote for p in self._points.values() for e in p.entries.values())

    def without(self, iteration: int, entry: EntryRecord, reason: str) -> "Catalog":
        """A copy with one entry dropped (found corrupt) and the problem recorded; a remote entry becomes a
        hole instead (see :attr:`holes`)."""
        points = dict(self._points)
        old = points[iteration]
        problems = self.problems + (Problem(iteration, entry.name, reason),)
        if entry.remote:
            assert entry.op is not None, "a remote entry is an operator's FULL entry"
            return Catalog(points, problems, self.holes | {(iteration, entry.op)}, self.damaged)
        damaged = self.damaged
        if entry.op is None:
            new = replace(old, meta=None)
        else:
            new = replace(old, entries={op: e for op, e in old.entries.items() if op != entry.op})
            if entry.level == Level.FULL:
                damaged = damaged | {(iteration, entry.op)}
        points[iteration] = new
        return Catalog(points, problems, self.holes, damaged)
