"""Glue between the runtime and the recovery machine: picks the rule for the policy, builds the
context, runs the machine, accounts token loss, and writes the report. Called by
``FTRuntime.on_train_start`` after a restart; the runtime hands over the step function (recovery never
imports the training loop)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from moe_ft.recovery.lossy import gather_expert_full_at, token_loss
from moe_ft.recovery.machine import Phase, Recovery, RecoveryConfig, RecoveryContext, RecoveryState
from moe_ft.state.optimizer_views import ensure_optimizer_state
from moe_ft.recovery.report import RecoveryReport
from moe_ft.state.operators import Level
from moe_ft.store import DenseRule, NewestFullRule, SparseWindowRule
from moe_ft.store.errors import StoreError

LOSSY = ("pec", "selective")


def recorded_windows(store) -> list[tuple[int, int]]:
    """The sparse windows ``(start, end)`` as the policy recorded them in the metadata of the store's points
    (its state after each snapshot). Recovery must use these, not windows aligned to this run's start
    iteration: a run resumed from a ``--load`` checkpoint, or whose window length was measured again
    (``--ft-sparse-window 0``), would otherwise look for windows that were never taken."""
    windows: set[tuple[int, int]] = set()
    for it in store.points():
        try:
            policy = store.load_meta(it).meta.get("policy") or {}
        except StoreError:  # a damaged metadata entry: agreement skips its point with the reason anyway
            continue
        for key in ("current", "previous"):
            w = policy.get(key)
            if w:
                windows.add((int(w["start"]), int(w["start"]) + int(w["length"]) - 1))
    return sorted(windows)


def rule_for(policy_name: str, policy, operators, window_offset: int, dense_interval: int = 1, store=None):
    if policy_name == "sparse":
        windows = recorded_windows(store) if store is not None else []
        if windows:
            return SparseWindowRule.explicit(operators, windows)
        return SparseWindowRule.aligned(operators, policy.window_length, window_offset)
    if policy_name == "dense":
        return DenseRule(operators=frozenset(operators))
    if policy_name in LOSSY:
        return NewestFullRule(operators=frozenset(operators))
    raise ValueError(f"no recovery rule for policy {policy_name!r}")


def should_recover(cfg, args) -> tuple[bool, int]:
    """Whether this start is a recovery, and the (largest) torchrun restart count (collective).

    ``--ft-recover auto`` recovers when *any* rank was restarted by torchrun: a replacement node's agent is
    fresh (``TORCHELASTIC_RESTART_COUNT`` 0) while the survivors' agents count a restart, and every rank
    must take the same path. It also recovers when the durable tier already holds a complete point of this
    job (the whole job was relaunched after losing every node: the in-memory tier is gone, the durable one
    is not)."""
    from moe_ft.persist import DurableTier

    restarts = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))], dtype=torch.int64)
    dist.all_reduce(restarts, op=dist.ReduceOp.MAX)
    restart_count = int(restarts.item())
    if cfg.ft_recover == "never":
        return False, restart_count
    if cfg.ft_recover == "always" or restart_count > 0:
        return True, restart_count
    persist_dir = cfg.ft_persist_dir or args.training.save
    durable = bool(cfg.ft_persist_interval and persist_dir and
                   DurableTier(persist_dir, cfg.ft_job_id, dist.get_world_size()).complete_points())
    return durable, restart_count


def progress_path(store_root: str, job_id: str, rank: int) -> Path:
    return Path(store_root) / job_id / f"progress_rank{rank}"


def write_progress(path: Path, iteration: int) -> None:
    """Record that ``iteration`` completed (atomically: a reader sees the old or the new number)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(iteration))
    os.replace(tmp, path)


def last_completed(store_root: str, job_id: str, rank: int, durable_dir: Path | None = None) -> int:
    """The newest iteration any rank completed before the failure (collective MAX; -1 if none): from the
    node-local progress files and, when every node was lost with them, from the one rank 0 keeps next to
    the durable tier (``durable_dir``)."""
    paths = [progress_path(store_root, job_id, rank)] + ([durable_dir / "progress"] if durable_dir else [])
    mine = max((int(p.read_text()) for p in paths if p.exists()), default=-1)
    t = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_skipped(mine: list[str], rank: int) -> list[str]:
    """Every rank's skipped-entry warnings, prefixed with the rank (collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [f"rank {rank}: {m}" for m in mine])
    return [m for part in gathered for m in part]


def seconds_since_last_fault(faults) -> float | None:
    """Drills: wall seconds from the newest fired fault (its marker's mtime) to now, i.e. failure
    detection + torchrun restart + process start + model build; ``None`` without fired faults."""
    fired = faults.fired() if faults else []
    if not fired:
        return None
    return time.time() - max((faults.marker_dir / f.marker_name).stat().st_mtime for f in fired)


def recover(rt, state, args, start_iteration: int, step_fn, restart_count: int) -> RecoveryReport:
    """Restore the newest recovery point every rank has; returns the report (``resume_iteration`` inside
    ``recovery_point['resume']``)."""
    from moe_ft.digest import global_digest

    t0 = time.perf_counter()
    since_fault = seconds_since_last_fault(rt.faults)
    cfg = rt.config
    ensure_optimizer_state(state.optimizer)
    rt._build()
    session = rt.active
    lossy = cfg.ft_policy in LOSSY
    lost_through = last_completed(cfg.ft_store_dir, cfg.ft_job_id, rt.rank,
                                  rt.persistence.tier.directory if rt.persistence is not None else None)
    t_fetch = time.perf_counter()
    fetched = fetch_lost_points(rt, session.store)
    t_fetch = time.perf_counter() - t_fetch
    ops = list(rt.registry)
    rule = rule_for(cfg.ft_policy, session.policy, ops, start_iteration, store=session.store)
    # a point older than the --load checkpoint would only re-execute more: never go behind it
    memory = BoundedStore(session.store, lo=start_iteration - 1)
    ctx = RecoveryContext(store=memory, registry=rt.registry, rule=rule, train_state=state, step_fn=step_fn,
                          popularity=rt.popularity, policy=session.policy,
                          fault_check=lambda it, phase: rt.check_fault(it, phase))
    rs = RecoveryState(fallback_iteration=start_iteration)
    Recovery(RecoveryConfig(lossy=lossy), ctx).run(rs)
    source = "memory"
    durable = durable_store(cfg, args, rt.rank, newer_than=start_iteration - 1) if rs.point is None else None
    if durable is not None:  # every node's memory tier lost the point: the durable tier is the last resort
        store, complete_end = durable
        memory = rs
        rs = RecoveryState(fallback_iteration=start_iteration, skipped=list(memory.skipped))
        ctx = replace(ctx, store=BoundedStore(store, hi=complete_end),
                      rule=rule_for(cfg.ft_policy, session.policy, ops, start_iteration, store=store))
        Recovery(RecoveryConfig(lossy=lossy), ctx).run(rs)
        rs.proposals = memory.proposals + rs.proposals
        rs.seconds = {k: memory.seconds.get(k, 0.0) + rs.seconds.get(k, 0.0) for k in {*memory.seconds, *rs.seconds}}
        if rs.point is not None:
            source = "durable"
            rs.message = (f"no recovery point in every rank's memory tier (node-local stores and replicas); "
                          f"recovered from the newest complete durable point (iteration {complete_end}) in "
                          f"{os.path.dirname(store.backend.describe())}")
    if t_fetch > 0.0005 and fetched:
        rs.seconds["fetch"] = t_fetch
    point = rs.point
    for line in rs.skipped:  # the reason, in the log of the rank that found it
        print(f"moe-ft recovery rank {rt.rank}: {line}", file=sys.stderr, flush=True)
    skipped = gather_skipped(rs.skipped, rt.rank)
    if skipped:
        rs.message = "; ".join(filter(None, [rs.message, "corrupt entries skipped: " + "; ".join(skipped)]))
    loss = {"tokens": 0.0, "metric": None, "value": 0.0}
    if point is not None:
        plan = session.policy.plan(point.end, rt.popularity)  # idempotent: the plan of `end` as it was
        fulls = [op for op, lvl in plan.items() if lvl == Level.FULL]
        since_full = rt.popularity.since_full.clone()  # as recorded at `end`, before mark_full(end)
        rt.popularity.mark_full(point.end, fulls)
        if lossy:
            expert_full_at = gather_expert_full_at(point.full_at)
            topk_tokens = args.training.global_batch_size * args.model.seq_length * args.model.moe_router_topk
            if cfg.ft_policy == "pec":
                denom = torch.full((since_full.shape[0],), float(args.training.train_iters * topk_tokens))
                metric = "PLT"
            else:
                denom = torch.full((since_full.shape[0],), float((point.end + 1) * topk_tokens))
                metric = "MLT"
            loss = token_loss(end=point.end, expert_full_at=expert_full_at, since_full=since_full,
                              moe_layers=rt.popularity.moe_layers, metric=metric, tokens_per_layer=denom)
            if cfg.ft_policy == "pec":
                loss["k_before"] = session.policy.k
                session.policy.on_recovery(point.end, loss["value"])
                loss["k_after"] = session.policy.k
    session.store.discard_after(rs.resume_iteration - 1)
    if point is not None and cfg.ft_policy == "sparse":
        realign_sparse_retention(rt, session, ops)
    if rt.replication is not None:  # replicas of the abandoned timeline must not outlive it (lossy runs differ)
        rt.replication.discard_after(rs.resume_iteration - 1)
    if rt.persistence is not None:
        rt.persistence.tier.discard_after(rt.rank, rs.resume_iteration - 1)
    digest = global_digest(state.model, state.optimizer, state.scheduler)
    if point is None:
        source = "checkpoint" if start_iteration else "initial"
    report = RecoveryReport(
        policy=cfg.ft_policy, restart_count=restart_count,
        failed={"last_completed": lost_through, "faults_fired": [str(f) for f in rt.faults.fired()] if rt.faults else []},
        recovery_point={"source": source, "start": point.start if point else start_iteration,
                        "end": point.end if point else start_iteration - 1, "resume": rs.resume_iteration,
                        "proposals": rs.proposals, **fetched},
        replayed_iterations=list(rs.replayed),
        reexecuted_iterations=list(range(rs.resume_iteration, lost_through + 1)),
        seconds={**{k: round(v, 4) for k, v in rs.seconds.items()}, "total": round(time.perf_counter() - t0, 4),
                 **({"restart": round(since_fault, 4)} if since_fault is not None else {})},
        bytes_loaded=rs.bytes_loaded, token_loss=loss, routing_checked=rs.routing_checked,
        recovered_digest=digest, message=rs.message)
    assert rs.phase is Phase.DONE
    return report


def realign_sparse_retention(rt, session, operators) -> None:
    """Retention and persistence built before recovery assumed windows aligned to this run's start
    iteration; the restored policy continues the recorded windows, so align both to those."""
    from moe_ft.recovery.retention import KeepTwoRecoverable

    window = session.policy.current
    rule = SparseWindowRule.aligned(operators, window.length, window.start % window.length)
    session.store.retention = KeepTwoRecoverable(rule=rule)
    if rt.persistence is not None:
        rt.persistence.rule = rule


def fetch_lost_points(rt, local) -> dict:
    """Node loss: rebuild node-local stores from replica holders and data-parallel peers (collective;
    ``moe_ft/replication/fetch.py``). Returns the report's ``{"fetched": {rank: …}}`` (ranks that fetched
    or could not), or ``{}`` without replication."""
    if rt.replication is None:
        return {}
    mine = rt.replication.fetch_missing(local)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine.to_json())
    fetched = {str(r): f for r, f in enumerate(gathered) if f["points"] or f["skipped"]}
    return {"fetched": fetched} if fetched else {}


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


def durable_store(cfg, args, rank: int, newer_than: int):
    """``(this rank's durable store, end of the newest complete durable point)`` if that point is newer than
    ``newer_than`` (the ``--load`` checkpoint's last iteration), else ``None``. Same answer on every rank
    (the completion markers are shared)."""
    from moe_ft.persist import DurableTier

    persist_dir = cfg.ft_persist_dir or args.training.save
    if not (cfg.ft_persist_interval and persist_dir):
        return None
    tier = DurableTier(persist_dir, cfg.ft_job_id, dist.get_world_size())
    ends = [e for e in tier.complete_points() if e > newer_than]
    return (tier.store(rank), ends[-1]) if ends else None


def report_dir(cfg) -> str:
    return cfg.ft_report_dir or os.path.join(cfg.ft_store_dir, cfg.ft_job_id, "reports")
