"""Common shape of snapshot policies (SPEC §2, §3).

A policy maps an iteration (and the expert popularity counters) to a :data:`SnapshotPlan` and does
nothing else: no bytes move, no process group is touched. Every rank builds the same policy from the same
*global* operator catalogue and calls :meth:`SnapshotPolicy.plan` with identical popularity counters, so
every rank gets the same plan; the snapshot engine keeps the entries of its own operators. Ties are always
broken by :class:`OperatorId` order.

Where an operator's bytes are copied is the ``(pp_rank, ep_rank)`` of its :class:`OperatorInfo` (its
*rank key*). The engine attributes non-expert operators (replicated over the expert-parallel ranks of a
stage) to the rank that snapshots them, e.g. round-robin over the stage's EP ranks (MoC §4.2), or lists
each rank's shard with the distributed optimizer. Per-rank budgets and balance are computed on that key.
"""

from __future__ import annotations

import abc
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan

if TYPE_CHECKING:  # only for annotations: policies read counters, they never build them
    from moe_ft.popularity import ExpertPopularity

RankKey = tuple[int, int]
"""``(pp_rank, ep_rank)``: the device whose link an operator's snapshot bytes cross."""


class SnapshotPolicy(abc.ABC):
    """Base of every policy. Subclasses set ``name`` and implement :meth:`plan`; stateful ones override
    :meth:`state_dict` / :meth:`load_state_dict` so a restarted job continues the same schedule."""

    name: str = ""

    def __init__(self, operators: Sequence[OperatorInfo]) -> None:
        self.operators: tuple[OperatorInfo, ...] = validate_operators(operators)
        self.info: Mapping[OperatorId, OperatorInfo] = MappingProxyType({i.op: i for i in self.operators})

    @abc.abstractmethod
    def plan(self, iteration: int, popularity: Optional["ExpertPopularity"] = None) -> SnapshotPlan:
        """The plan for the snapshot taken after iteration ``iteration``: every operator → a level.

        Calling it twice with the same arguments and state returns the same plan."""

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state of policy {state.get('name')!r} cannot be loaded into policy {self.name!r}")

    def plan_bytes(self, plan: SnapshotPlan) -> dict[RankKey, int]:
        """Bytes each rank key copies for ``plan`` (a helper for engines, tests and the simulator)."""
        return bytes_per_rank(plan, self.info)


def validate_operators(operators: Sequence[OperatorInfo]) -> tuple[OperatorInfo, ...]:
    """Check the catalogue (no duplicates, sane sizes) and return it sorted by :class:`OperatorId`."""
    infos = sorted(operators, key=lambda i: i.op)
    if not infos:
        raise ValueError("a policy needs at least one operator; pass the model's OperatorInfo catalogue")
    for prev, cur in zip(infos, infos[1:]):
        if prev.op == cur.op:
            raise ValueError(f"operator {cur.op} is listed twice; each OperatorId must appear once")
    for info in infos:
        if info.bytes_compute < 0 or info.bytes_full < info.bytes_compute:
            raise ValueError(
                f"{info.op}: need 0 <= bytes_compute <= bytes_full, got {info.bytes_compute}, {info.bytes_full}"
            )
    return tuple(infos)


def make_plan(operators: Iterable[OperatorInfo], levels: Mapping[OperatorId, Level]) -> SnapshotPlan:
    """A read-only plan listing every operator explicitly (missing ones are ``NONE``), in OperatorId order."""
    return MappingProxyType({op: Level(levels.get(op, Level.NONE)) for op in sorted(i.op for i in operators)})


def rank_key(info: OperatorInfo) -> RankKey:
    return (info.pp_rank, info.ep_rank)


def bytes_per_rank(plan: SnapshotPlan, info: Mapping[OperatorId, OperatorInfo]) -> dict[RankKey, int]:
    totals: dict[RankKey, int] = {rank_key(i): 0 for i in info.values()}
    for op, level in plan.items():
        totals[rank_key(info[op])] += info[op].nbytes(level)
    return totals


def experts_by_layer(operators: Iterable[OperatorInfo]) -> dict[int, list[OperatorInfo]]:
    """Expert operators grouped by layer, each group sorted by expert index; layers in ascending order."""
    layers: dict[int, list[OperatorInfo]] = {}
    for info in sorted(operators, key=lambda i: i.op):
        if info.op.is_expert:
            layers.setdefault(info.op.layer, []).append(info)
    return dict(sorted(layers.items()))


def expert_scores(
    popularity: Optional["ExpertPopularity"], experts: Iterable[OperatorInfo], source: str
) -> dict[OperatorId, float]:
    """Counter ``source`` for each expert; all zeros without popularity (then ties → OperatorId order)."""
    if popularity is None:
        return {i.op: 0.0 for i in experts}
    table = popularity.counter(source)
    return {i.op: float(table[popularity.layer_pos(i.op.layer), i.op.expert]) for i in experts}


def top_by_score(candidates: Sequence[OperatorInfo], scores: Mapping[OperatorId, float], k: int) -> list[OperatorInfo]:
    """The ``k`` candidates with the highest score, ties broken by OperatorId order."""
    return sorted(candidates, key=lambda i: (-scores[i.op], i.op))[: max(k, 0)]

