"""Collective agreement on the recovery point (the job agrees on the newest recovery point
that every needed operator has).

Every rank searches its node-local store for the newest point its rule accepts, checksumming the entries
the point needs (``newest_recoverable(verify=True)``: a corrupt or torn entry is skipped with a warning
naming it, never loaded). The ranks then exchange their candidates' ``end`` iterations; while they
differ, every rank searches again at or before the smallest one. The search only moves backwards, so it
ends with one iteration every rank can restore, or with ``None`` on every rank (then the caller falls back
to the persisted Megatron checkpoint).
"""

from __future__ import annotations

import logging
from typing import Callable

from moe_ft import comm

log = logging.getLogger("moe_ft.recovery")


def _min_over_ranks(value: int, group=None) -> int:
    return comm.min_over_ranks(value, group)  # host path: the coordination gloo group unless a host group is given


def agree_on_point(find: Callable[[int | None], object], group=None) -> tuple[object | None, list[int]]:
    """``find(at_or_before)`` → this rank's newest acceptable ``RecoveryPoint`` (or ``None``). Returns the
    agreed point (the same ``end`` on every rank, ``None`` everywhere if some rank has none) and the
    sequence of proposals (for the report). ``group``: a host (gloo) group, default the coordination group
    of all ranks (``moe_ft.comm``). An agreed point where ranks holding the same operator would restore it from
    different iterations (:func:`_restored_apart`) is refused on every rank and the search goes on before it."""
    bound: int | None = None
    proposals = []
    while True:
        point = find(bound)
        mine = point.end if point is not None else -1
        agreed = _min_over_ranks(mine, group)
        proposals.append(agreed)
        if agreed < 0:
            return None, proposals
        if _min_over_ranks(int(mine == agreed), group) == 1:
            split = _restored_apart(point, group)
            if split is None:
                return point, proposals
            log.warning("moe-ft recovery: point %d not taken: %s; searching before it", agreed, split)
            agreed -= 1
            if agreed < 0:
                return None, proposals
        bound = agreed


def _restored_apart(point: object, group=None) -> str | None:
    """Collective: where ranks that hold the same operator (data-parallel replicas, tensor-parallel shards)
    would restore it from FULL entries of different iterations at the agreed point, one such operator in
    words; ``None`` where none would. Each rank's rule takes each operator's newest FULL entry its own store
    holds: a point one rank never published (its store was full) or an entry found damaged on one rank only
    would otherwise leave the replicas with different weights, silently."""
    mine = {op: int(it) for op, it in (getattr(point, "full_at", None) or {}).items()}
    seen: dict = {}
    for rank, part in enumerate(comm.all_gather_object(mine, group)):
        for op, it in part.items():
            first = seen.setdefault(op, (it, rank))
            if first[0] != it:
                return f"{op} is restored from iteration {first[0]} on rank {first[1]} but {it} on rank {rank}"
    return None
