"""Retention: which published points garbage collection keeps. A policy object, separate from the store
mechanism; the store asks it after every publish and deletes the rest. Every policy here keeps at least one
complete recovery point (by the caller's completeness rule) while the next one is in flight, and never
deletes anything while no complete point exists yet."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable

from moe_ft.state.operators import OperatorId
from moe_ft.store.catalog import Catalog
from moe_ft.store.rules import DenseRule, NewestFullRule, RecoveryRule, SparseWindowRule, newest_recoverable


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
    experts per layer, so ``floor`` (default: each operator's newest FULL, :class:`NewestFullRule`) also
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


def retention_for_policy(policy: str, operators: Iterable[OperatorId], *, window_size: int | None = None,
                         window_offset: int = 0) -> RetentionPolicy:
    """The natural retention of each snapshot policy of SPEC §3 (``selective`` behaves like ``pec``)."""
    ops = frozenset(operators)
    if policy == "dense":
        return KeepNewestRecoverable(rule=DenseRule(operators=ops))
    if policy == "sparse":
        if window_size is None:
            raise ValueError("sparse retention needs window_size (W_sparse from FindWindowSize)")
        return KeepNewestRecoverable(rule=SparseWindowRule.aligned(ops, window_size, window_offset))
    if policy in ("pec", "selective"):
        return TripleBuffer(floor=NewestFullRule(operators=ops))
    raise ValueError(f"unknown snapshot policy {policy!r}; expected dense, sparse, pec or selective")
