"""The global operator catalogue the policies plan over (``docs/policies.md``: every rank builds the same
policy from the same global list).

Every rank contributes its registry's :class:`OperatorInfo` list; the lists are all-gathered and merged
per operator into one :class:`CatalogueInfo`:

* byte sizes: the largest over the ranks holding the operator (with the distributed optimizer each
  data-parallel rank holds a different shard; a plan must fit the fullest one);
* ``pp_rank``: the stage holding it; ``ep_rank``: for an expert, the expert-parallel rank holding it; for a
  non-expert operator (replicated over the stage's EP ranks) round-robin over the stage's EP ranks in
  OperatorId order (MoC §4.2): a *home* for policies that order or slice operators per rank;
* ``copies``: where a plan's bytes for the operator are really copied. The snapshot engine of every rank
  copies every operator of the plan that its registry holds, so an expert is copied by the ranks of its EP
  rank and a non-expert by **every** rank of its stage (each holds a replica, or its own shard of the
  master and optimizer state with the distributed optimizer). One entry per holding rank:
  ``(rank, pp_rank, ep_rank, bytes_compute, bytes_full)``.

Per-device byte accounting (budgets, balance, the benchmark's bytes) is :func:`copied_bytes`: per rank
key ``(pp_rank, ep_rank)`` the bytes of its fullest rank (data-parallel ranks share a key; with the
distributed optimizer their shards differ, and the fullest rank is the one a per-device budget must fit),
exactly what that rank's engine copies. Charging a non-expert to its home EP rank alone under-counts every
other EP rank of the stage; summing per-operator maxima over a key's ranks over-counts sharded state.

The merge is a pure function (:func:`merge_catalogue`), testable without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

from moe_ft import comm
from moe_ft.state.operators import Level, OperatorId, OperatorInfo

RankKey = tuple[int, int]
"""``(pp_rank, ep_rank)``: the device whose link a snapshot's bytes cross (``moe_ft.policy.base``)."""

Holder = tuple[object, RankKey]
"""``(rank, rank key)`` of a rank that copies an operator (``rank`` is a key stand-in for hand-built
catalogues that name no ranks)."""


@dataclass(frozen=True, kw_only=True)
class CatalogueInfo(OperatorInfo):
    """An :class:`OperatorInfo` of the global catalogue, with where its bytes are copied."""

    copies: tuple[tuple[int, int, int, int, int], ...] = ()
    """``(rank, pp_rank, ep_rank, bytes_compute, bytes_full)`` for every global rank whose engine copies the
    operator when a plan saves it, sorted by rank."""

    def charges(self, level: Level) -> list[tuple[Holder, int]]:
        """``[((rank, (pp_rank, ep_rank)), bytes)]`` a plan saving this operator at ``level`` costs."""
        if level == Level.NONE:
            return []
        return [((rank, (pp, ep)), full if level == Level.FULL else compute)
                for rank, pp, ep, compute, full in self.copies]


def charges_of(info: OperatorInfo, level: Level) -> list[tuple[Holder, int]]:
    """Where ``info``'s bytes at ``level`` are copied: its ``copies`` for a :class:`CatalogueInfo`, else its
    own rank key, as one device (a hand-built catalogue that lists each operator on one device)."""
    if isinstance(info, CatalogueInfo) and info.copies:
        return info.charges(level)
    key = (info.pp_rank, info.ep_rank)
    return [((key, key), info.nbytes(level))] if level != Level.NONE else []


def copied_bytes_per_rank(plan: Mapping[OperatorId, Level], catalogue) -> dict[Holder, int]:
    """Bytes each holder ``(rank, rank key)`` copies for ``plan``: exactly what its snapshot engine copies
    (``OperatorRegistry.nbytes(plan)`` on that rank). Every holder listed, zeros included."""
    info = catalogue if isinstance(catalogue, Mapping) else {i.op: i for i in catalogue}
    totals: dict[Holder, int] = {}
    for i in info.values():
        for holder, _ in charges_of(i, Level.FULL):
            totals.setdefault(holder, 0)
    for op, level in plan.items():
        for holder, nbytes in charges_of(info[op], Level(level)):
            totals[holder] += nbytes
    return totals


def copied_bytes(plan: Mapping[OperatorId, Level],
                 catalogue: Union[Mapping[OperatorId, OperatorInfo], Sequence[OperatorInfo]]) -> dict[RankKey, int]:
    """Bytes each rank key copies for ``plan`` (every key of the catalogue listed, zeros included): what the
    snapshot engine of the fullest rank of that key copies."""
    totals: dict[RankKey, int] = {}
    for (_, key), nbytes in copied_bytes_per_rank(plan, catalogue).items():
        totals[key] = max(totals.get(key, 0), nbytes)
    return totals


def merge_catalogue(per_rank: Iterable[Sequence[OperatorInfo]], ep_size: int) -> list[CatalogueInfo]:
    """Merge the ranks' local lists into one :class:`CatalogueInfo` per operator, sorted by OperatorId."""
    """``per_rank[r]``: the list of global rank ``r`` (``all_gather_object`` order)."""
    merged: dict[OperatorId, list[tuple[int, OperatorInfo]]] = {}
    for rank, infos in enumerate(per_rank):
        for info in infos:
            merged.setdefault(info.op, []).append((rank, info))
    out: list[CatalogueInfo] = []
    non_expert_count: dict[int, int] = {}
    for op in sorted(merged):
        ranked = merged[op]
        holders = [h for _, h in ranked]
        stages = {h.pp_rank for h in holders}
        if len(stages) != 1:
            raise RuntimeError(f"operator {op} is held by several pipeline stages {sorted(stages)}; shared "
                               "embeddings across stages are not supported (use untied embeddings)")
        pp = stages.pop()
        if op.is_expert:
            eps = {h.ep_rank for h in holders}
            if len(eps) != 1:
                raise RuntimeError(f"expert {op} is held by several expert-parallel ranks {sorted(eps)}")
            ep = eps.pop()
        else:
            ep = non_expert_count.get(pp, 0) % max(ep_size, 1)
            non_expert_count[pp] = non_expert_count.get(pp, 0) + 1
        copies = tuple((rank, h.pp_rank, h.ep_rank, h.bytes_compute, h.bytes_full) for rank, h in ranked)
        out.append(CatalogueInfo(op=op, bytes_compute=max(h.bytes_compute for h in holders),
                                 bytes_full=max(h.bytes_full for h in holders), pp_rank=pp, ep_rank=ep,
                                 copies=copies))
    return out


def gather_catalogue(local: Sequence[OperatorInfo], ep_size: int, group=None) -> list[CatalogueInfo]:
    """All-gather every rank's list (object collective on the host path, ``moe_ft.comm``: ``group`` a host
    group, default the coordination group of all ranks) and merge it."""

    return merge_catalogue(comm.all_gather_object(list(local), group), ep_size)
