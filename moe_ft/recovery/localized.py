"""Localized recovery (MoEvement §3.4, App. A): only the failed ranks' pipeline stages roll back.

Called by :func:`moe_ft.recovery.driver.recover` before the global path; every step is collective over all
ranks, and every rank reaches the same outcome::
    survey            every rank: its survivor point (verified), its own newest window, its upstream log
    decide_scope      moe_ft/localized/scope.py (pure): target T, replaying ranks, loading ranks, or global
    exchange_logs     the replaying ranks fetch the log entries of [replay_from, T] (h12a's mechanism)
    load | replay     loading ranks: their survivor point (every operator FULL + the metadata of T; held in
                      memory by a process that stayed, else published in the node store)
                      replaying ranks: the recovery machine on their own window [s, e] over a host group of
                      their own, its step function run under LogReplay (stage inputs and the results of
                      collectives spanning stages from the logs), then the lost iterations e+1 … T the same way
    agree on outcome  the loading ranks first wait on the replay's progress (``heartbeat.py``: bounded by
                      the time without progress, not by one collective's timeout); then any error (a log
                      entry missing or not matching, a replay that diverged) on any rank: every rank
                      goes on with the global path (the report says why)
    popularity/policy the job-wide counters and the policy's state at T come from a loading rank's point

Then every rank holds the state of iteration T; training resumes at T+1. A failure while this runs
restarts the job again: loading ranks have re-armed their survivor guard with T (they publish it again),
replaying ranks publish nothing, so the next scope includes them and whoever died (cascading, App. A).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.localized.log_replay import LogReplay, exchange_logs
from moe_ft.localized.log_store import LogUnavailable
from moe_ft.localized.scope import RankReport, Scope, decide_scope
from moe_ft.recovery.bounded import BoundedStore
from moe_ft.recovery.heartbeat import ReplayProgress
from moe_ft.recovery.machine import MachineConfig, Recovery, RecoveryContext, RecoveryState, restore_step_state

if TYPE_CHECKING:
    from moe_ft.recovery.inputs import RecoveryInputs


def _contiguous_tail(iterations: list[int]) -> tuple[int, int] | None:
    """``(first, last)`` of the gap-free run of logged iterations that ends at the newest one."""
    if not iterations:
        return None
    its = sorted(iterations)
    first = its[-1]
    for it in reversed(its[:-1]):
        if it != first - 1:
            break
        first = it
    return first, its[-1]


def survey(inputs: "RecoveryInputs") -> list[RankReport]:
    """Every rank's :class:`RankReport` (collective, host path)."""

    ops = list(inputs.registry)
    survivor, why = inputs.survivor_points.newest(ops)
    store = BoundedStore(inputs.session.store, lo=inputs.start_iteration - 1)
    rule = inputs.session.policy.recovery_rule(ops, store=store, start_iteration=inputs.start_iteration)
    point = store.newest_recoverable(rule, at_or_before=survivor if survivor >= 0 else None)
    logged = _contiguous_tail(inputs.log_dir.iterations()) if inputs.log_dir is not None else None
    pp_ranks = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    mine = RankReport(rank=inputs.rank, pp_rank=pp_ranks.index(inputs.rank), pp_ranks=pp_ranks, survivor=survivor,
                      survivor_why_not=why, window=(point.start, point.end) if point is not None else None,
                      logged=logged)
    return [RankReport(**{**d, "pp_ranks": tuple(d["pp_ranks"]),
                          "window": tuple(d["window"]) if d["window"] else None,
                          "logged": tuple(d["logged"]) if d["logged"] else None})
            for d in comm.all_gather_object(asdict(mine))]


def decide(inputs: "RecoveryInputs") -> Scope:
    """The scope every rank agrees on (collective)."""
    if inputs.config.recovery.recovery_scope == "global":
        return Scope("global", "--ft-recovery-scope global")
    if inputs.survivor_points is None:
        return Scope("global", "no survivor store (snapshots off)")
    if inputs.session.policy.lossy:  # its recovery restores stale FULL entries and never replays
        return Scope("global", f"--ft-policy {inputs.session.name} is lossy: every rank restores its newest FULL "
                               "entries (a replay from logs needs an exact policy)")
    return decide_scope(survey(inputs), requested=inputs.config.recovery.recovery_scope)


def _load(inputs: "RecoveryInputs", scope: Scope, out: dict) -> None:
    """A loading rank: its survivor point at ``scope.target`` into the live state; re-arm the guard."""

    t0 = time.perf_counter()
    out["bytes_loaded"] = inputs.survivor_points.load(inputs.registry, scope.target)
    meta, tensors = inputs.survivor_points.meta(scope.target)
    restore_step_state(meta, tensors, train_state=inputs.state, popularity=inputs.popularity,
                       policy=inputs.session.policy)
    if inputs.survivor is not None:  # a stop during the rest of the recovery publishes this state again
        inputs.survivor.adopt(scope.target, meta, tensors)
    out["seconds"]["load"] = round(time.perf_counter() - t0, 4)
    inputs.check_fault(scope.target, "recovery")  # drills: a loading rank lost while the others replay


def _replay(inputs: "RecoveryInputs", scope: Scope, feed, group, out: dict, progress: ReplayProgress) -> None:
    """A replaying rank: its own window through the machine, then the lost iterations, all log-fed; each
    replayed iteration is a beat of ``progress`` (what the loading ranks wait on)."""

    t0 = time.perf_counter()
    policy = inputs.session.policy
    store = BoundedStore(inputs.session.store, lo=inputs.start_iteration - 1, hi=scope.target)
    up = inputs.upstream
    assert up is not None, "a localized replay needs the upstream logs (the scope was chosen from them)"
    with LogReplay(up.seams, feed, replaying=scope.replaying, rank=inputs.rank, recorder=up.recorder) as replay:
        def step_fn(iteration, optimizer):
            with replay.iteration(iteration):
                result = inputs.step_fn(iteration, optimizer)
            progress.beat()
            return result

        ctx = RecoveryContext(store=store, registry=inputs.registry,
                              rule=policy.recovery_rule(list(inputs.registry), store=store,
                                                        start_iteration=inputs.start_iteration),
                              train_state=inputs.state, step_fn=step_fn, popularity=None, policy=policy,
                              fault_check=inputs.check_fault, group=group)
        # the grad-norm all-reduce is served from the collective log (the original global norm), so the
        # replay takes it as the original run did instead of the recorded scalar: the log's call order holds
        config = MachineConfig(lossy=False, check_routing=False, use_recorded_grad_norm=False)
        rs = Recovery(config, ctx).run(RecoveryState(fallback_iteration=inputs.start_iteration))
        if rs.point is None:
            raise RuntimeError(f"the replaying ranks {scope.replaying} have no recovery point in common")
        lost = list(range(rs.point.end + 1, scope.target + 1))
        t_lost = time.perf_counter()
        for t in lost:
            inputs.check_fault(t, "recovery")
            step_fn(t, inputs.state.optimizer)
    out["bytes_loaded"] = rs.bytes_loaded
    out["window"] = [rs.point.start, rs.point.end]
    out["replayed"] = list(rs.replayed) + lost
    out["seconds"].update({k: round(v, 4) for k, v in rs.seconds.items()})
    out["seconds"]["lost"] = round(time.perf_counter() - t_lost, 4)
    out["seconds"]["replay_total"] = round(time.perf_counter() - t0, 4)


def _job_wide_state(inputs: "RecoveryInputs", scope: Scope) -> None:
    """Popularity counters (summed over the job) and the policy's state at the target, from the lowest
    loading rank's point, onto the replaying ranks (they could not all-reduce with the others)."""

    src = scope.loading[0]
    payload = None
    if inputs.rank == src:
        meta, tensors = inputs.survivor_points.meta(scope.target)
        payload = {"popularity": meta.get("popularity"), "policy": meta.get("policy"),
                   "tensors": {k: v for k, v in tensors.items() if k.startswith("popularity.")}}
    payload = comm.broadcast_object(payload, src=src)
    if inputs.rank in scope.replaying:
        if inputs.popularity is not None and payload["popularity"] is not None:
            pop = dict(payload["popularity"])
            pop.update({k[len("popularity."):]: v for k, v in payload["tensors"].items()})
            inputs.popularity.load_state_dict(pop)
        if payload["policy"] is not None:
            inputs.session.policy.load_state_dict(payload["policy"])


def run(inputs: "RecoveryInputs", scope: Scope) -> dict | None:
    """The localized recovery of ``scope`` (collective). Returns this rank's outcome (``role``, ``replayed``,
    ``bytes_loaded``, ``log_bytes``, ``seconds``) when every rank succeeded; ``None`` with
    ``scope.reason`` rewritten when the job must go on with the global path."""

    out: dict = {"rank": inputs.rank, "role": "replay" if inputs.rank in scope.replaying else "load",
                 "replayed": [], "bytes_loaded": 0, "log_bytes": 0, "seconds": {}, "error": ""}
    group = comm.new_host_group(scope.replaying, desc="MOE_FT_LOCALIZED_REPLAY") if scope.replaying else None
    feed = None
    if scope.replaying:
        t0 = time.perf_counter()
        try:  # raises alike on every rank

            feed = exchange_logs(inputs.log_dir, replaying=scope.replaying,
                                 iterations=range(scope.replay_from, scope.target + 1))
        except LogUnavailable as e:
            scope.mode, scope.reason = "global", f"localized recovery impossible, logs: {e}"
            return None
        out["log_bytes"] = feed.nbytes
        out["seconds"]["exchange_logs"] = round(time.perf_counter() - t0, 4)
    progress = ReplayProgress.for_recovery(scope.target, scope.replaying,
                                           60.0 * inputs.args.training.distributed_timeout_minutes)
    scope.rewrote_state = True  # on every rank: the loaders' live tensors change now, the replayers' as they go
    try:
        if out["role"] == "load":
            _load(inputs, scope, out)
        else:
            progress.start_alive()
            try:
                _replay(inputs, scope, feed, group, out, progress)
            finally:
                progress.done()
    except (LogUnavailable, RuntimeError, ValueError) as e:  # a replay that cannot go on: tell every rank
        out["error"] = f"rank {inputs.rank}: {type(e).__name__}: {e}"
    if out["role"] == "load" and scope.replaying:  # bounded by progress, not by the group's timeout
        out["seconds"]["wait_replay"] = round(progress.wait(), 4)
    outcomes = comm.all_gather_object(out)
    errors = [o["error"] for o in outcomes if o["error"]]
    if errors:
        scope.mode, scope.reason = "global", "localized replay failed, " + "; ".join(errors)
        return None
    _job_wide_state(inputs, scope)
    scope_outcomes = {"outcomes": outcomes}
    out.update(scope_outcomes)
    return out
