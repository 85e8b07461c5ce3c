"""An immutable view of the published points of a store, built from their manifests, with the queries
recovery needs. Entries that failed a check are absent from the view and listed in ``problems``."""

from __future__ import annotations

from dataclasses import dataclass
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
    def __init__(self, points: Mapping[int, PointRecord], problems: Iterable[Problem] = ()) -> None:
        self._points = dict(sorted(points.items()))
        self.problems: tuple[Problem, ...] = tuple(problems)

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

    def without(self, iteration: int, entry: EntryRecord, reason: str) -> "Catalog":
        """A copy with one entry dropped (found corrupt) and the problem recorded."""
        points = dict(self._points)
        old = points[iteration]
        if entry.op is None:
            new = PointRecord(old.iteration, old.checksum_algo, old.entries, None, old.created_unix, old.writer)
        else:
            entries = {op: e for op, e in old.entries.items() if op != entry.op}
            new = PointRecord(old.iteration, old.checksum_algo, entries, old.meta, old.created_unix, old.writer)
        points[iteration] = new
        return Catalog(points, self.problems + (Problem(iteration, entry.name, reason),))
