"""Retention that keeps a recovery point common to all ranks.

Each rank garbage-collects its own store after each publish. With ``KeepNewestRecoverable`` a rank whose
newest window completed deletes the previous one while a slower rank (killed with that window's last
snapshot still in flight) only has the previous one: then no point is common to all ranks (found by the
failure drill). Snapshots are at most one recovery point apart across ranks (iterations are synchronised
by collectives), so keeping the newest **two** recoverable points per rank always leaves a common one.

The lossy policies (``pec``, ``selective``) use it too, with their ``NewestFullRule`` (in place of the
store's ``TripleBuffer`` floor, which keeps only each operator's newest FULL entry): a rank that published
iteration ``e`` while another was killed with ``e`` in flight must still restore ``e - 1``, which needs the
FULL entries that were newest at ``e - 1`` (found by the pec drill: proposals ``[5, -1]``, the job restarted
from the initial state)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_ft.store import Catalog, RecoveryRule, RetentionPolicy, newest_recoverable


@dataclass(frozen=True, kw_only=True)
class KeepTwoRecoverable(RetentionPolicy):
    rule: RecoveryRule
    """Completeness rule (``DenseRule`` / ``SparseWindowRule`` / ``NewestFullRule``)."""

    def keep(self, catalog: Catalog) -> set[int]:
        newest = newest_recoverable(catalog, self.rule)
        if newest is None:
            return set(catalog.iterations)
        previous = newest_recoverable(catalog, self.rule, newest.end - 1)
        if previous is None:  # keep everything older until a second point exists
            return set(catalog.iterations)
        return set(newest.iterations) | set(previous.iterations) | {it for it in catalog.iterations if it > newest.end}
