"""The recovery planner: one place that decides where each operator's state comes from, and how exact
that is.

Sources, best first, with their correctness level::
    window_replay   sparse window + replay from the rank's own store (MoEvement §3.3)    exact
    nondeterministic_replay  a replay with --no-deterministic (same iterations and data)  nondeterministic
    local_point     a dense point of the rank's own store (no replay)                   exact
    survivor_point  the state a surviving rank published when the job stopped           exact (localized scope)
    peer_replica    the rank's points fetched from replica holders / DP peers           exact
    durable_point   the newest complete point of the durable tier                       durable
    checkpoint      the --load Megatron checkpoint                                      durable
    lossy           newest FULL entry of a pec/selective snapshot (PLT / MLT reported)  lossy
    checkfree       the stage rebuilt from its neighbours (CheckFree §4.2)              approximate
    replay_beside_rebuilt  exact start, but trained during replay next to a rebuilt stage  approximate
    start_over      the initial weights (iteration 0)                                   start over

The decision (:func:`decide`, a pure function of what every rank has) is per job, so that every rank takes
the same path: the memory tier when every rank has a point there; else the durable tier; else the
``--load`` checkpoint; else CheckFree when the ranks without any point are intermediate pipeline stages
whose neighbours have one; else start over. Below ``--ft-min-recovery-level`` it refuses with one line
(:class:`RecoveryRefused`), before anything is restored; after the restore the levels actually reached per
operator (:func:`operator_sources`) are checked again, recorded in the report (``recovery_levels``) and
appended to the job's audit log (``<job dir>/recovery_audit.jsonl``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Sequence

import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.checkfree.recovery import (
    RebuildImpossible,
    RebuiltStageStore,
    Wildcard,
    exchange_and_rebuild,
    rebuild_sources,
)
from moe_ft.recovery.agreement import agree_on_point

LEVELS = ("start_over", "approximate", "lossy", "durable", "nondeterministic", "exact")
"""Correctness levels, worst first. ``exact`` is bitwise the state the failed run had; ``nondeterministic``:
replayed on the same data, but with ``--no-deterministic`` kernels that need not give the same bits twice."""

MIN_LEVEL_CHOICES = ("exact", "nondeterministic", "durable", "lossy", "approximate", "none")
"""``--ft-min-recovery-level``: the worst level a recovery may reach (``none``: any, even starting over)."""

SOURCE_LEVEL = {"window_replay": "exact", "local_point": "exact", "survivor_point": "exact", "peer_replica": "exact",
                "nondeterministic_replay": "nondeterministic", "durable_point": "durable", "checkpoint": "durable",
                "lossy": "lossy", "checkfree": "approximate", "replay_beside_rebuilt": "approximate",
                "start_over": "start_over"}
SOURCE_ORDER = tuple(SOURCE_LEVEL)


class RecoveryRefused(RuntimeError):
    """The best available recovery is below ``--ft-min-recovery-level`` (one-line message)."""


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def worst(levels: Iterable[str]) -> str:
    return min(levels, key=level_rank, default="exact")


def check_min_level(level: str, min_level: str, why: str) -> None:
    """Raise :class:`RecoveryRefused` when ``level`` is below ``min_level``."""
    if min_level not in MIN_LEVEL_CHOICES:
        raise ValueError(f"--ft-min-recovery-level must be one of {MIN_LEVEL_CHOICES}, got {min_level!r}")
    if min_level != "none" and level_rank(level) < level_rank(min_level):
        raise RecoveryRefused(f"moe-ft recovery refused: the best available recovery is {level} ({why}) but "
                              f"--ft-min-recovery-level is {min_level}; lower it to accept this recovery")


@dataclass(frozen=True)
class RankInventory:
    """What one rank can recover from (gathered from every rank)."""

    rank: int
    pp_rank: int
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline group, in stage order (its neighbours hold the same data-,
    expert- and tensor-parallel coordinates)."""
    memory_end: int
    """End of the newest recovery point in the rank's memory tier (own store and fetched replicas), -1: none."""
    fetched: bool = False
    """The rank's points came from replica holders / data-parallel peers (node loss)."""


@dataclass
class RecoveryPlan:
    """What :func:`decide` chose for the job (the same on every rank)."""

    path: str
    """``memory`` | ``durable`` | ``checkpoint`` | ``checkfree`` | ``start_over``."""
    level: str
    """The level this path reaches at best (the report records the level actually reached per operator)."""
    reason: str
    lost_ranks: list[int] = field(default_factory=list)
    rebuilt: dict[int, tuple[int, int]] = field(default_factory=dict)
    """CheckFree: lost rank -> (previous-stage rank, next-stage rank) it is rebuilt from, or (swap partner,)
    under CheckFree+."""
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "rebuilt": {str(k): list(v) for k, v in self.rebuilt.items()}}


def checkfree_sources(inventories: Sequence[RankInventory], plus: bool = False) -> tuple[dict[int, tuple[int, ...]], str]:
    """For the ranks without a memory point: ``{lost rank: (previous, next)}`` if CheckFree can rebuild
    every one of them (an intermediate stage whose two pipeline neighbours have a point: §4.2), with
    ``plus`` (CheckFree+, §4.3) ``{lost rank: (swap partner,)}`` for a stage that has a swap partner (the
    first and last stage included), else ``({}, why not)``."""

    return rebuild_sources(inventories, plus=plus)


def decide(inventories: Sequence[RankInventory], *, durable_end: int | None, load_iteration: int,
           lossy: bool, checkfree_plus: bool = False, model_chunks: int = 1) -> RecoveryPlan:
    """The job's recovery path (pure; every rank computes the same from the gathered inventories).
    ``model_chunks``: model chunks per rank (virtual pipeline stages); CheckFree rebuilds one."""
    lost = sorted(inv.rank for inv in inventories if inv.memory_end < 0)
    if not lost:
        return RecoveryPlan("memory", "lossy" if lossy else "exact",
                            "every rank has a recovery point in its memory tier")
    missing = f"ranks {lost} have no recovery point in memory (own store or replicas)"
    if durable_end is not None:
        return RecoveryPlan("durable", "durable", f"{missing}; the durable tier has a complete point "
                                                  f"(iteration {durable_end})", lost_ranks=lost)
    if load_iteration > 0:
        return RecoveryPlan("checkpoint", "durable", f"{missing} and there is no durable point; the --load "
                                                     f"checkpoint (iteration {load_iteration}) is older", lost_ranks=lost)
    if model_chunks > 1:
        rebuilt, why_not = {}, (f"CheckFree rebuilds one model chunk per rank and this job has {model_chunks} "
                                "(virtual pipeline stages)")
    else:
        rebuilt, why_not = checkfree_sources(inventories, plus=checkfree_plus)
    if rebuilt:
        stages = sorted({inv.pp_rank for inv in inventories if inv.rank in rebuilt})
        how = ("neighbours (CheckFree) or, for a first/last stage, their swap partner and the embedding/output "
               "copies (CheckFree+)") if checkfree_plus else "neighbours (CheckFree)"
        return RecoveryPlan("checkfree", "approximate", f"{missing}, no durable point and no checkpoint: pipeline "
                                                        f"stage(s) {stages} can only be rebuilt from their {how}",
                            lost_ranks=lost, rebuilt=rebuilt)
    return RecoveryPlan("start_over", "start_over", f"{missing}, no durable point, no checkpoint, and {why_not}",
                        lost_ranks=lost)


def replay_source(deterministic: bool) -> str:
    """The source of an operator a replay computed: ``window_replay`` (exact), or with ``--no-deterministic``
    ``nondeterministic_replay``: the same iterations on the same data, but kernels (atomics, cuBLAS and
    attention algorithms on GPU) that may give other bits than the run that failed."""
    return "window_replay" if deterministic else "nondeterministic_replay"


def operator_sources(ops: Iterable, *, path: str, point, rebuilt_here: bool, fetched_here: bool, lossy: bool,
                     resumed_from: str, deterministic: bool = True) -> dict[str, str]:
    """``{operator: source}`` for this rank's operators after the restore. ``point``: the agreed
    ``RecoveryPoint`` (``None``: no point was restored); ``resumed_from``: the driver's source
    (``memory`` / ``durable`` / ``checkpoint`` / ``initial``); ``deterministic``: ``--deterministic`` (without
    it, an operator the replay computed, whose FULL entry is older than the point's end, is not bitwise)."""
    out = {}
    for op in ops:
        replayed = point is not None and point.end > point.start and point.full_at.get(op, point.end) < point.end
        if rebuilt_here:
            src = "checkfree"
        elif point is None:
            src = "checkpoint" if resumed_from == "checkpoint" else "start_over"
        elif lossy and point.full_at.get(op, point.end) < point.end:
            src = "lossy"
        elif path == "checkfree" and replayed:
            src = "replay_beside_rebuilt"  # trained during the replay with a rebuilt stage in the pipeline
        elif resumed_from == "durable":
            src = "durable_point"  # its replay is no worse than re-executing after an older point
        elif replayed and not deterministic:
            src = replay_source(deterministic)
        elif fetched_here:
            src = "peer_replica"
        else:
            src = "window_replay" if point.end > point.start and not lossy else "local_point"  # lossy: no replay
        out[str(op)] = src
    return out


def summarize(per_rank: Sequence[Mapping[str, str]]) -> dict:
    """Merge the ranks' ``{operator: source}`` (an operator held by several ranks keeps its worst source)."""
    merged: dict[str, str] = {}
    for sources in per_rank:
        for op, src in sources.items():
            if op not in merged or level_rank(SOURCE_LEVEL[src]) < level_rank(SOURCE_LEVEL[merged[op]]):
                merged[op] = src
    counts: dict[str, int] = {}
    for src in merged.values():
        counts[src] = counts.get(src, 0) + 1
    return {"level": worst(SOURCE_LEVEL[s] for s in merged.values()), "sources": dict(sorted(counts.items())),
            "operators": dict(sorted(merged.items()))}


def append_audit(path: str, record: Mapping) -> None:
    """Append one JSON line to the audit log (append-only: never rewritten)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}, sort_keys=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------ collective steps
@dataclass
class PlanContext:
    """This rank's side of a plan (not shared): the store its recovery reads and what CheckFree did here."""

    plan: RecoveryPlan
    store: object = None
    """``None``: the rank's own (bounded) store; else the store the machine runs on (a rebuilt stage's)."""
    rebuilt: object = None
    """``moe_ft.checkfree.recovery.Rebuilt`` on a rebuilt stage's rank."""
    fetched_here: bool = False
    inventories: list[RankInventory] = field(default_factory=list)

    @property
    def check_routing(self) -> bool:
        return self.plan.path != "checkfree"  # a rebuilt stage routes differently by construction


def plan_recovery(*, rank: int, find, fetched_here: bool, durable_end: int | None, load_iteration: int,
                  lossy: bool, min_level: str, audit_path: str | None = None, restart_count: int = 0,
                  checkfree_plus: bool = False, model_chunks: int = 1) -> PlanContext:
    """Gather every rank's inventory, decide, refuse below ``min_level`` (collective, host path; a refusal
    is audited too). ``find(at_or_before)``: this rank's newest point in its memory tier (bounded by
    ``--load``)."""

    point = find(None)
    pp_ranks = tuple(dist_ranks(ps.get_pipeline_model_parallel_group())) if ps.model_parallel_is_initialized() else (rank,)
    mine = RankInventory(rank=rank, pp_rank=pp_ranks.index(rank), pp_ranks=pp_ranks,
                         memory_end=point.end if point is not None else -1, fetched=fetched_here)
    inventories = [RankInventory(**d) for d in comm.all_gather_object(asdict(mine))]
    plan = decide(inventories, durable_end=durable_end, load_iteration=load_iteration, lossy=lossy,
                  checkfree_plus=checkfree_plus, model_chunks=model_chunks)
    try:
        check_min_level(plan.level, min_level, plan.reason)
    except RecoveryRefused as e:
        if rank == 0 and audit_path:
            append_audit(audit_path, {"restart_count": restart_count, "refused": str(e), "path": plan.path,
                                      "planned": plan.level, "reason": plan.reason, "min_level": min_level,
                                      "lost_ranks": plan.lost_ranks})
        raise
    return PlanContext(plan=plan, fetched_here=fetched_here, inventories=inventories)


def dist_ranks(group) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def prepare_checkfree(ctx: PlanContext, *, rank: int, find, store, registry, lossy: bool, state,
                      min_level: str = "none", copies=None) -> None:
    """CheckFree path (collective): the survivors agree on their point (the lost ranks accept any), the
    lost ranks get their neighbours' layers and rebuild (``moe_ft/checkfree/recovery.py``). If the
    survivors have no common point, the plan becomes ``start_over``."""

    plan = ctx.plan
    lost = rank in plan.rebuilt
    point, _ = agree_on_point(lambda bound: Wildcard(bound if bound is not None else 2 ** 62) if lost else find(bound))
    if point is None:
        plan.path, plan.level = "start_over", "start_over"
        plan.reason += "; but the surviving stages have no recovery point in common"
        check_min_level(plan.level, min_level, plan.reason)
        return
    pp_rank_of = {inv.rank: inv.pp_rank for inv in ctx.inventories}
    try:
        ctx.rebuilt = exchange_and_rebuild(rank=rank, rebuilt=plan.rebuilt, pp_rank_of=pp_rank_of, store=store,
                                           registry=registry, point=None if lost else point, lossy=lossy, state=state,
                                           copies=copies)
    except RebuildImpossible as e:  # every rank raises it (a copy is missing or corrupt); nothing overwritten
        plan.path, plan.level = "start_over", "start_over"
        plan.reason += f"; but {e}"
        check_min_level(plan.level, min_level, plan.reason)
        return
    if ctx.rebuilt is not None:
        ctx.store = RebuiltStageStore(registry, ctx.rebuilt)
    comm.barrier()


def record_levels(ctx: PlanContext, *, rank: int, ops, rs, source: str, lossy: bool, min_level: str,
                  audit_path: str | None, report, deterministic: bool) -> dict:
    """Per-operator sources after the restore (gathered), the report's ``recovery_levels``, the audit-log
    line (rank 0), and the final check against ``min_level`` (collective). ``deterministic``:
    ``--deterministic`` (:func:`operator_sources`)."""

    plan = ctx.plan
    mine = operator_sources(ops, path=plan.path, point=rs.point, rebuilt_here=ctx.rebuilt is not None,
                            fetched_here=ctx.fetched_here, lossy=lossy, resumed_from=source,
                            deterministic=deterministic)
    rebuilt = None
    if ctx.rebuilt is not None:
        w = ctx.rebuilt.weights
        rebuilt = {"rank": rank, "from": list(ctx.rebuilt.sources), "weights": [w.prev, w.next], "note": w.note}
    gathered = comm.all_gather_object({"sources": mine, "rebuilt": rebuilt})
    levels = summarize([g["sources"] for g in gathered])
    levels.update(path=plan.path, planned=plan.level, reason=plan.reason, min_level=min_level,
                  unavailable=plan.unavailable, rebuilt=[g["rebuilt"] for g in gathered if g["rebuilt"]])
    report.recovery_levels = levels
    if rank == 0 and audit_path:
        append_audit(audit_path, {"restart_count": report.restart_count, "policy": report.policy,
                                  "resume": report.recovery_point.get("resume"), **levels})
    check_min_level(levels["level"], min_level, f"{plan.reason}; operators: {levels['sources']}")
    return levels
