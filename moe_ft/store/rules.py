"""Completeness rules: "can a policy recover from the store so that its state at iteration ``end`` is
restored, and which entries does that need?" The store stays policy-agnostic; recovery passes a rule.

A rule is any callable ``rule(catalog, end) -> RecoveryPoint | None``. The natural ones:

- :class:`DenseRule` — every operator FULL at ``end`` (dense checkpointing, CheckFreq/Gemini).
- :class:`SparseWindowRule` — MoEvement §3.2–3.3 sparse-to-dense conversion over a window
  ``[start, end]``: every operator has a FULL entry at some ``f`` in the window (where it becomes
  *active*) and an entry (COMPUTE, its frozen weights) at every iteration in ``[start, f)``.
- :class:`NewestFullRule` — lossy recovery (``pec``/``selective``, MoC §5, MoEtion §6): every operator
  restored from its newest FULL entry at or before ``end``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, cast

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.catalog import Catalog


@dataclass(frozen=True, order=True)
class EntryRef:
    """Key of one entry: ``op is None`` (and ``level is None``) denotes the metadata entry."""

    iteration: int
    op: OperatorId | None = None
    level: Level | None = None


@dataclass(frozen=True)
class RecoveryPoint:
    """What recovery loads: ``full_at[op]`` is the iteration whose FULL entry restores ``op``; ``entries``
    lists every entry needed (FULL, the COMPUTE entries of frozen operators, metadata). The restored
    state is that after iteration ``end``; replay (sparse) starts at ``start``."""

    start: int
    end: int
    full_at: dict[OperatorId, int]
    entries: tuple[EntryRef, ...]

    @property
    def iterations(self) -> list[int]:
        return sorted({e.iteration for e in self.entries} | {self.end})


RecoveryRule = Callable[[Catalog, int], "RecoveryPoint | None"]


def op_order(op: OperatorId) -> tuple[str, int, int]:
    """Sort key giving :class:`OperatorId`'s own order (its fields in declaration order) without the
    dataclass's Python-level ``__lt__``: rules run after every publish (garbage collection)."""
    return op.kind, op.layer, op.expert


def _meta_refs(catalog: Catalog, iterations: Iterable[int], require_meta: bool) -> list[EntryRef] | None:
    refs = []
    for it in iterations:
        if catalog.has_meta(it):
            refs.append(EntryRef(it))
        elif require_meta:
            return None
    return refs


def dense_complete(catalog: Catalog, end: int, operators: Iterable[OperatorId],
                   require_meta: bool = True) -> RecoveryPoint | None:
    point = catalog.point(end)
    ops = sorted(operators, key=op_order)
    # cheap necessary condition first: GC asks this of every recent point, most hold few or no entries
    if point is None or len(point.entries) < len(ops) or any(point.level(op) != Level.FULL for op in ops):
        return None
    meta = _meta_refs(catalog, [end], require_meta)
    if meta is None:
        return None
    return RecoveryPoint(end, end, {op: end for op in ops},
                         tuple(EntryRef(end, op, Level.FULL) for op in ops) + tuple(meta))


def sparse_window_complete(catalog: Catalog, start: int, end: int, operators: Iterable[OperatorId],
                           require_meta: bool = True) -> RecoveryPoint | None:
    if start > end:
        raise ValueError(f"window start {start} is after its end {end}")
    window = [(it, catalog.point(it)) for it in range(start, end + 1)]
    if any(point is None for _, point in window):
        return None  # a missing snapshot in the window breaks the replay
    full_at: dict[OperatorId, int] = {}
    refs: list[EntryRef] = []
    # GC asks this after every publish: the window's entry tables are read directly (PointRecord.level)
    tables = [(it, point.entries) for it, point in window]  # type: ignore[union-attr]  # none is None: above
    for op in sorted(operators, key=op_order):
        for it, entries in tables:
            entry = entries.get(op)
            level = Level.NONE if entry is None else entry.level
            if level == Level.FULL:
                full_at[op] = it
                refs.append(EntryRef(it, op, Level.FULL))
                break
            if level != Level.COMPUTE:
                return None  # frozen at `it` without its compute weights
            refs.append(EntryRef(it, op, Level.COMPUTE))
        else:
            return None  # never FULL in the window
    meta = _meta_refs(catalog, range(start, end + 1), require_meta)
    if meta is None:
        return None
    return RecoveryPoint(start, end, full_at, tuple(refs + meta))


@dataclass(frozen=True, kw_only=True)
class DenseRule:
    operators: frozenset[OperatorId]
    """Operators this rank must restore."""
    require_meta: bool = True
    """Also require the per-iteration metadata entry (RNG, loss scale, …) at the point."""

    def __call__(self, catalog: Catalog, end: int) -> RecoveryPoint | None:
        return dense_complete(catalog, end, self.operators, self.require_meta)


@dataclass(frozen=True, kw_only=True)
class SparseWindowRule:
    operators: frozenset[OperatorId]
    """Operators this rank must restore."""
    window_of: Callable[[int], tuple[int, int] | None]
    """Maps an iteration to the window ``(start, end)`` that ends there, or ``None`` if no window ends
    there. Use :meth:`aligned` for fixed windows or :meth:`explicit` for the policy's window history."""
    require_meta: bool = True
    """Require a metadata entry at every iteration of the window (exact replay needs each one)."""

    @classmethod
    def aligned(cls, operators: Iterable[OperatorId], window_size: int, offset: int = 0,
                require_meta: bool = True) -> "SparseWindowRule":
        """Windows ``[offset + k*W, offset + (k+1)*W - 1]``."""
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")

        def window_of(end: int) -> tuple[int, int] | None:
            start = end - window_size + 1
            return (start, end) if start >= offset and (start - offset) % window_size == 0 else None

        return cls(operators=frozenset(operators), window_of=window_of, require_meta=require_meta)

    @classmethod
    def explicit(cls, operators: Iterable[OperatorId], windows: Sequence[tuple[int, int]],
                 require_meta: bool = True) -> "SparseWindowRule":
        """Windows given as ``(start, end)`` pairs (e.g. after a reorder changed the window size)."""
        by_end = {end: (start, end) for start, end in windows}
        return cls(operators=frozenset(operators), window_of=by_end.get, require_meta=require_meta)

    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """Recent answers by window, with the point records they were computed from: garbage collection asks this
    rule after every publish about the same one or two windows, whose records (a store keeps the ones it wrote)
    have not changed. Not pickled."""

    MEMO_SIZE = 8

    def __call__(self, catalog: Catalog, end: int) -> RecoveryPoint | None:
        window = self.window_of(end)
        if window is None:
            return None
        points = tuple(catalog.point(it) for it in range(window[0], window[1] + 1))
        key = (window, tuple(map(id, points)))
        hit = self._memo.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], points)):  # the same records: the same answer
            return hit[1]
        result = sparse_window_complete(catalog, window[0], window[1], self.operators, self.require_meta)
        if len(self._memo) >= self.MEMO_SIZE:  # old windows: start again (clear is atomic; the rule may be asked
            self._memo.clear()  # by recovery on the training thread while GC asks it on the snapshot thread)
        self._memo[key] = (points, result)  # keeps the records alive: their ids are not reused meanwhile
        return result

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _memo={})


@dataclass(frozen=True, kw_only=True)
class NewestFullRule:
    operators: frozenset[OperatorId]
    """Operators this rank must restore."""
    require_meta: bool = True
    """Require the metadata entry at ``end``."""
    local_only: bool = False
    """Treat every remote entry (held by the replica peers, :attr:`EntryRecord.remote`) as unavailable:
    the newest point this store restores without any peer (retention keeps it as the fallback)."""

    def __call__(self, catalog: Catalog, end: int) -> RecoveryPoint | None:
        if catalog.point(end) is None:
            return None
        full_at = catalog.newest_full_map(sorted(self.operators, key=op_order), end)
        # An operator whose newest FULL state (as the snapshot of ``end`` recorded it: the popularity
        # counters were reset there) cannot be restored makes ``end`` unusable; restoring an older FULL
        # entry instead would lose tokens the recorded counters do not count.
        if any(it is None or catalog.unavailable(it, op, local_only=self.local_only) for op, it in full_at.items()):
            return None
        # Likewise a newer FULL entry of it dropped as damaged (``Catalog.damaged``): its newest state is lost.
        if catalog.damaged and any((d := catalog.newest_damaged(op, end)) is not None and d > cast(int, it)
                                   for op, it in full_at.items()):
            return None
        meta = _meta_refs(catalog, [end], self.require_meta)
        if meta is None:
            return None
        full = cast("dict[OperatorId, int]", full_at)  # no None left: checked above
        refs = tuple(EntryRef(it, op, Level.FULL) for op, it in full.items()) + tuple(meta)
        return RecoveryPoint(min(full.values(), default=end), end, dict(full), refs)


def newest_recoverable(catalog: Catalog, rule: RecoveryRule, at_or_before: int | None = None) -> RecoveryPoint | None:
    """The recovery point with the largest ``end`` (≤ ``at_or_before``) that ``rule`` accepts."""
    for end in reversed(catalog.iterations):
        if at_or_before is not None and end > at_or_before:
            continue
        point = rule(catalog, end)
        if point is not None:
            return point
    return None


def portable(rule: RecoveryRule, ends: Iterable[int]) -> RecoveryRule:
    """``rule`` as a value another process can be sent (pickled): a :class:`SparseWindowRule` whose
    ``window_of`` reads live policy state becomes the explicit windows it gives for ``ends`` (the points
    the receiver may consider); the other rules are plain data already."""
    if isinstance(rule, SparseWindowRule):
        windows = [w for end in ends if (w := rule.window_of(end)) is not None]
        return SparseWindowRule.explicit(rule.operators, windows, require_meta=rule.require_meta)
    return rule
