"""Retention that keeps a recovery point common to all ranks.

Each rank garbage-collects its own store after each publish. With ``KeepNewestRecoverable`` a rank whose
newest window completed deletes the previous one while a slower rank (killed with that window's last
snapshot still in flight) only has the previous one: then no point is common to all ranks (found by the
failure drill). Snapshots are at most one recovery point apart across ranks (iterations are synchronised
by collectives), so keeping the newest **two** recoverable points per rank always leaves a common one."""

from __future__ import annotations

from dataclasses import dataclass

from moe_ft.store import Catalog, RecoveryRule, RetentionPolicy, newest_recoverable


@dataclass(frozen=True, kw_only=True)
class KeepTwoRecoverable(RetentionPolicy):
    rule: RecoveryRule
    """Completeness rule (``DenseRule`` / ``SparseWindowRule``)."""

    def keep(self, catalog: Catalog) -> set[int]:
        newest = newest_recoverable(catalog, self.rule)
        if newest is None:
            return set(catalog.iterations)
        previous = newest_recoverable(catalog, self.rule, newest.end - 1)
        if previous is None:  # keep everything older until a second point exists
            return set(catalog.iterations)
        return set(newest.iterations) | set(previous.iterations) | {it for it in catalog.iterations if it > newest.end}
