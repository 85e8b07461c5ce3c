"""A view of a snapshot store whose recovery points must end inside an interval of iterations."""

from __future__ import annotations


class BoundedStore:
    """A store whose recovery points must end in ``[lo, hi]``: not after the newest *complete* durable point
    (a newer point some ranks finished writing is not one the whole job can trust yet), not before the
    ``--load`` checkpoint (restoring it would only re-execute more)."""

    def __init__(self, store, *, lo: int | None = None, hi: int | None = None) -> None:
        self._store, self.lo, self.hi = store, lo, hi

    def newest_recoverable(self, rule, *, at_or_before=None, verify=False):
        bound = at_or_before if self.hi is None else (self.hi if at_or_before is None else min(at_or_before, self.hi))
        point = self._store.newest_recoverable(rule, at_or_before=bound, verify=verify)
        return None if point is None or (self.lo is not None and point.end < self.lo) else point

    def __getattr__(self, name):
        return getattr(self._store, name)
