"""Retention: which published points garbage collection keeps. A policy object, separate from the store
mechanism; the store asks it after every publish and deletes the rest. Every policy here that has a completeness
rule (``KeepNewestRecoverable``, ``KeepTwoRecoverable``, ``TripleBuffer`` with a ``floor``) keeps at least one
complete recovery point by it while the next one is in flight, and deletes nothing while no complete point
exists yet; ``TripleBuffer(floor=None)`` (MoC's literal scheme) keeps its buffers only. The runtime uses
``KeepTwoRecoverable`` (``moe_ft/snapshot/session.py``)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Any, cast

from moe_ft.store.catalog import Catalog
from moe_ft.store.rules import RecoveryRule, newest_recoverable


class RetentionPolicy(abc.ABC):
    @abc.abstractmethod
    def keep(self, catalog: Catalog) -> set[int]:
        """Iterations (of ``catalog``) to keep; the store deletes the other published points."""


class KeepAll(RetentionPolicy):
    def keep(self, catalog: Catalog) -> set[int]:
        return set(catalog.iterations)


@dataclass(frozen=True, kw_only=True)
class KeepNewestRecoverable(RetentionPolicy):
    """Keep the newest recovery point ``rule`` accepts plus every newer point (the one in flight: the
    next dense point, or the partially written next sparse window). MoEvement §3.2: "one persisted
    checkpoint and another in-flight, garbage-collecting the oldest checkpoint after persisting a new one"."""

    rule: RecoveryRule
    """Completeness rule, e.g. :class:`DenseRule` or :class:`SparseWindowRule`."""

    def keep(self, catalog: Catalog) -> set[int]:
        point = newest_recoverable(catalog, self.rule)
        if point is None:
            return set(catalog.iterations)
        return set(point.iterations) | {it for it in catalog.iterations if it > point.end}


@dataclass(frozen=True, kw_only=True)
class TripleBuffer(RetentionPolicy):
    """MoC-System §5.2 triple buffering: a *snapshot* buffer (the point in flight, not yet published), a
    *persist* buffer (the newest published point, being persisted) and a *recovery* buffer (the one
    before it): the newest ``num_buffers - 1`` published points are kept. PEC points hold only ``K``
    experts per layer, so a ``floor`` (e.g. each operator's newest FULL, :class:`NewestFullRule`) also
    keeps the points that a lossy recovery needs, which keeps one complete recovery point in memory."""

    num_buffers: int = 3
    """Buffers including the one being snapshotted (MoC uses three)."""
    floor: RecoveryRule | None = None
    """Rule whose newest recovery point is always kept; ``None`` keeps only the buffers (then operators
    whose FULL state fell out of them must come from the durable tier, as in MoC's two-level scheme)."""

    def __post_init__(self) -> None:
        if self.num_buffers < 2:
            raise ValueError(f"num_buffers must be >= 2 (one in flight, one published), got {self.num_buffers}")

    def keep(self, catalog: Catalog) -> set[int]:
        keep = set(catalog.iterations[-(self.num_buffers - 1):])
        if self.floor is not None:
            point = newest_recoverable(catalog, self.floor)
            if point is None:
                return set(catalog.iterations)
            keep |= set(point.iterations)
        return keep


@dataclass(frozen=True, kw_only=True)
class KeepTwoRecoverable(RetentionPolicy):
    """Keep the newest two recovery points by ``rule`` (and every newer point): the runtime's retention,
    which keeps a recovery point common to all ranks.

    Each rank garbage-collects its own store after each publish. With ``KeepNewestRecoverable`` a rank whose
    newest window completed deletes the previous one while a slower rank (killed with that window's last
    snapshot still in flight) only has the previous one: then no point is common to all ranks (found by the
    failure drill). Snapshots are at most one recovery point apart across ranks (iterations are synchronised
    by collectives), so keeping the newest **two** recoverable points per rank always leaves a common one.

    The lossy policies (``pec``, ``selective``) use it too, with their ``NewestFullRule`` (in place of
    ``TripleBuffer(floor=NewestFullRule)``, which keeps only each operator's newest FULL entry): a rank that published
    iteration ``e`` while another was killed with ``e`` in flight must still restore ``e - 1``, which needs the
    FULL entries that were newest at ``e - 1`` (found by the pec drill: proposals ``[5, -1]``, the job restarted
    from the initial state)."""

    rule: RecoveryRule
    """Completeness rule (``DenseRule`` / ``SparseWindowRule`` / ``NewestFullRule``)."""

    def keep(self, catalog: Catalog) -> set[int]:
        newest = newest_recoverable(catalog, self.rule)
        if newest is None:
            return set(catalog.iterations)
        previous = newest_recoverable(catalog, self.rule, newest.end - 1)
        if previous is None:  # keep everything older until a second point exists
            return set(catalog.iterations)
        keep = set(newest.iterations) | set(previous.iterations) | {it for it in catalog.iterations if it > newest.end}
        local = getattr(self.rule, "local_only", None)
        if local is False and catalog.has_remote:
            # Some FULL states are held by the replica peers only (--ft-optimizer-recompute-local compute):
            # also keep the newest point this store restores without them, the fallback when no peer answers.
            # None when no such point exists (with churn some expert's newest FULL state is usually the
            # peers'); the newest points then depend on the peers, and nothing extra is kept: keeping every
            # point until one appears would grow without bound.
            fallback = newest_recoverable(catalog, replace(cast(Any, self.rule), local_only=True))  # a dataclass
            if fallback is not None:
                keep |= set(fallback.iterations)
        return keep
