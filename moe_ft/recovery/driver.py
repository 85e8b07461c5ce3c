"""Recovery at start-up: decide whether this start is a recovery, then restore the newest point
every rank has and account for what the failure cost.

:func:`recover` takes everything it acts on in one :class:`RecoveryInputs` (the runtime builds it; recovery
never imports the training loop: the loop's step function comes in as ``step_fn``). It runs named steps:

0. :func:`check_saved_schedules`  what every rank may restore against the flags' LR schedule and global batch
                               size, before anything is restored or a store changed (``schedule.py``: Megatron-LM's
                               rule, as ``--load``; a refusal stops every rank with one line)
1. :func:`lost_iterations`     newest iteration any rank completed (progress records, collective)
2. :func:`fetch_lost_points`   rebuild node-local stores of a lost node from peers (collective)
   :func:`try_localized`       survivors load the state they published, only the failed stages replay from
                               their neighbours' logs (``localized_attempt.py``, ``localized.py``); on success
                               recovery ends here, else the steps below run with the reason in the report
3. :func:`plan_recovery`       the planner (``planner.py``) picks the source, refuses below
                               ``--ft-min-recovery-level``; CheckFree rebuilds a lost stage (collective)
4. :func:`restore_newest_point`  the state machine (``machine.py``) on the memory tier, else on the newest
                               complete durable point
5. :func:`account_token_loss`  popularity as of the point; lossy policies: PLT/MLT (MoC eq. 7, MoEtion §6)
6. :func:`drop_abandoned_timeline`  store points after the resume point; retention by the restored policy
7. :func:`build_report`, then :func:`record_recovery_levels` (per-operator levels, audit log, lr boost)

Once a point is restored (localized or global), ``--override-opt-param-scheduler`` puts the flags' LR schedule at
its position (:meth:`ScheduleRule.after_restore`), before the report's digest.

What a policy means for recovery (its completeness rule, whether it is lossy, its metric) is asked of the
policy object (``moe_ft/policy/base.py``), never decided here by name.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moe_ft import comm
from moe_ft.checkfree.recovery import boost_rebuilt_stage
from moe_ft.digest import global_digest
from moe_ft.persist import DurableTier
from moe_ft.persist.fit import durable_misfit, durable_misfit_error
from moe_ft.recovery import planner
from moe_ft.recovery.bounded import BoundedStore
from moe_ft.recovery.decisions import agreed_avoided, note_avoided, recording
from moe_ft.recovery.inputs import (
    RecoveryInputs,
    audit_path,
    discard_survivor_points,
    durable_store,
    durable_tier,
    phase_seconds,
    seconds_since_last_fault,
)
from moe_ft.recovery.ledger import GLOBAL, DecisionLedger
from moe_ft.recovery.localized_attempt import try_localized
from moe_ft.recovery.lossy import gather_expert_full_at, token_loss
from moe_ft.recovery.machine import MachineConfig, Phase, Recovery, RecoveryContext, RecoveryState
from moe_ft.recovery.progress import last_completed
from moe_ft.recovery.report import RecoveryReport
from moe_ft.recovery.schedule import ScheduleRule, recovery_sources, stop_unless_agreed
from moe_ft.replication.component import Replicas
from moe_ft.state.operators import Level

if TYPE_CHECKING:
    from moe_ft.config import FTConfig



def should_recover(cfg: "FTConfig", args) -> tuple[bool, int]:
    """Whether this start is a recovery, and the (largest) torchrun restart count (collective).

    ``--ft-recover auto`` recovers when *any* rank was restarted by torchrun: a replacement node's agent is
    fresh (``TORCHELASTIC_RESTART_COUNT`` 0) while the survivors' agents count a restart, and every rank
    must take the same path. It also recovers when the durable tier already holds a complete point of this
    job (the whole job was relaunched after losing every node: the in-memory tier is gone, the durable one
    is not)."""

    restart_count = comm.max_over_ranks(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    mode = cfg.recovery.recover
    if mode == "never":
        return False, restart_count
    if mode == "always" or restart_count > 0:
        return True, restart_count
    root = cfg.persist.root(args.training.save)
    durable = bool(cfg.persist.interval and root and
                   DurableTier(root, cfg.snapshot.job_id, dist.get_world_size()).complete_points())
    return durable, restart_count


def recover(inputs: RecoveryInputs) -> RecoveryReport:
    """Restore the newest recovery point every rank has; returns the report (the iteration training
    resumes at is ``report.recovery_point['resume']``)."""
    t0 = time.perf_counter()
    since_fault = seconds_since_last_fault(inputs.faults)
    rule = check_saved_schedules(inputs)
    lost_through = lost_iterations(inputs)
    t_fetch = time.perf_counter()
    fetched = fetch_lost_points(inputs)
    t_fetch = time.perf_counter() - t_fetch
    ledger = DecisionLedger(inputs.config.job_dir(), inputs.rank)
    avoided = agreed_avoided(ledger)
    scope, report = try_localized(inputs, lost_through=lost_through, since_fault=since_fault, t0=t0,
                                  ledger=ledger, avoided=avoided, rule=rule)
    if report is not None:
        note_avoided(report, avoided)
        ledger.clear()
        return report
    if inputs.survivor is not None:  # loaders adopted the target; the global path rewrites their live state
        inputs.survivor.forget()
    plan = plan_recovery(inputs, fetched, below=avoided.below)
    plan.plan.unavailable["survivor_point"] = f"not used: {scope.reason}"
    rs, source = restore_newest_point(inputs, plan, below=avoided.below, ledger=ledger)
    if rs.point is None and scope.rewrote_state:
        # the fallback resumes from the state this process started with (the initial weights or the --load
        # checkpoint), which the failed localized attempt partly overwrote: not a state to train on
        raise RuntimeError(
            f"moe-ft recovery: the localized recovery to iteration {scope.target} failed ({scope.reason}) after "
            "it had rewritten part of the live state, and no rank has a recovery point in common to rewrite all "
            f"of it; the job must start again from {'the --load checkpoint' if inputs.start_iteration else 'its initial state'} "
            "in new processes (the next attempt does not try the localized recovery again)")
    inputs.check_fault(lost_through + 1, "fallback")  # drills: lost while the global path rewrote the state
    if rs.point is not None:  # else the --load checkpoint's or the initial schedule, which follows the rule
        rule.after_restore(inputs.state)
    if t_fetch > 0.0005 and fetched:
        rs.seconds["fetch"] = t_fetch
    report_skipped(inputs, rs)
    loss = account_token_loss(inputs, rs.point, durable=source == "durable")
    drop_abandoned_timeline(inputs, rs, rebuilt=plan.plan.path == "checkfree")
    if rs.point is None:
        source = "checkpoint" if inputs.start_iteration else "initial"
    seconds = phase_seconds(rs.seconds, t0, since_fault)
    report = build_report(inputs, rs, source=source, lost_through=lost_through, fetched=fetched, loss=loss,
                          seconds=seconds)
    report.scope = {"mode": "global", "reason": scope.reason, "target": scope.target, "failed": scope.failed,
                    "bytes_loaded": {str(r): b for r, b in enumerate(comm.all_gather_object(rs.bytes_loaded))}}
    record_recovery_levels(inputs, plan, rs, source, report)
    note_avoided(report, avoided)
    discard_survivor_points(inputs)
    ledger.clear()
    return report


def check_saved_schedules(inputs: RecoveryInputs) -> ScheduleRule:
    """Step 0 (collective): every rank checks what it may restore from -- its node-local points not older
    than the ``--load`` checkpoint, its survivor point, the newest complete durable point -- against the
    flags (``schedule.py``), before anything is restored, fetched or deleted; a refusal stops every rank.
    Returns the rule, which applies ``--override-opt-param-scheduler`` once a point is restored."""
    rule = ScheduleRule(training=inputs.args.training)
    lo = inputs.start_iteration - 1
    durable = durable_store(inputs, newer_than=lo)
    sources = recovery_sources(inputs.session.store, lo=lo, survivor_points=inputs.survivor_points,
                               durable=durable)
    problem = rule.first_problem(sources)
    tier = durable_tier(inputs)
    if problem is None and durable is not None and tier is not None:
        # a relaunch with other model flags: stop before the planner starts over and retention replaces the points
        misfit = durable_misfit(tier, durable[1], inputs.rank, inputs.registry)
        problem = None if misfit is None else durable_misfit_error(tier, durable[1], misfit)
    stop_unless_agreed(problem, inputs.rank)
    return rule


# ------------------------------------------------------------------------------------------------ steps
def lost_iterations(inputs: RecoveryInputs) -> int:
    """The newest iteration any rank completed before the failure (collective)."""
    snap = inputs.config.snapshot
    return last_completed(snap.store_dir, snap.job_id, inputs.rank, inputs.durable_dir)


def fetch_lost_points(inputs: RecoveryInputs) -> dict:
    """Node loss: rebuild node-local stores from replica holders and data-parallel peers (collective;
    ``moe_ft/replication/fetch.py``). Returns the report's ``{"fetched": {rank: …}}`` (ranks that fetched
    or could not), or ``{}`` without replication."""
    replicas = inputs.find(Replicas)
    if replicas is None or replicas.fetch is None:
        return {}
    mine = replicas.fetch.fetch_missing(inputs.session.store)
    gathered = comm.all_gather_object(mine.to_json())
    fetched = {str(r): f for r, f in enumerate(gathered) if f["points"] or f["skipped"] or f.get("completed")}
    return {"fetched": fetched} if fetched else {}


def plan_recovery(inputs: RecoveryInputs, fetched: dict, below: int | None = None):
    """Where the state comes from (``planner.py``, collective): every rank's memory-tier point, the durable
    tier, ``--load``; refuses below ``--ft-min-recovery-level``; on the CheckFree path the lost stages'
    ranks are rebuilt from their neighbours here (``moe_ft/checkfree/recovery.py``). ``below``: the newest
    point allowed (a newer one failed to restore before)."""

    lo = inputs.start_iteration - 1
    store, policy = BoundedStore(inputs.session.store, lo=lo, hi=below), inputs.session.policy
    rule = policy.recovery_rule(list(inputs.registry), store=store, start_iteration=inputs.start_iteration)
    find = lambda bound: store.newest_recoverable(rule, at_or_before=bound)  # noqa: E731 (verified later)
    durable = durable_store(inputs, newer_than=lo)
    ctx = planner.plan_recovery(
        rank=inputs.rank, find=find, fetched_here=bool(fetched.get("fetched", {}).get(str(inputs.rank), {}).get("points")),
        durable_end=durable[1] if durable else None, load_iteration=inputs.start_iteration, lossy=policy.lossy,
        min_level=inputs.config.recovery.min_recovery_level, audit_path=audit_path(inputs),
        restart_count=inputs.restart_count, checkfree_plus=inputs.config.checkfree.plus,
        model_chunks=len(inputs.state.model))
    if ctx.plan.path == "checkfree":
        planner.prepare_checkfree(ctx, rank=inputs.rank, find=find, store=inputs.session.store,
                                  registry=inputs.registry, lossy=policy.lossy, state=inputs.state,
                                  min_level=inputs.config.recovery.min_recovery_level,
                                  copies=inputs.config.checkfree.copy_store(inputs.config.job_dir(), inputs.rank))
    return ctx


def _machine(inputs: RecoveryInputs, store, rs: RecoveryState, check_routing: bool = True) -> RecoveryState:
    policy = inputs.session.policy
    ctx = RecoveryContext(store=store, registry=inputs.registry,
                          rule=policy.recovery_rule(list(inputs.registry), store=store,
                                                    start_iteration=inputs.start_iteration),
                          train_state=inputs.state, step_fn=inputs.step_fn, popularity=inputs.popularity,
                          policy=policy, fault_check=inputs.check_fault)
    return Recovery(MachineConfig(lossy=policy.lossy, check_routing=check_routing), ctx).run(rs)


def restore_newest_point(inputs: RecoveryInputs, plan=None, *, below: int | None = None,
                         ledger: DecisionLedger | None = None) -> tuple[RecoveryState, str]:
    """Run the state machine on the memory tier (node-local store and fetched replicas; a rebuilt stage's
    rank: its rebuilt layers, ``plan.store``), bounded below by the ``--load`` checkpoint and above by
    ``below`` (a newer point failed to restore before); if no point is common to every rank there, on the
    newest complete durable point. Returns the final state and the source (``memory`` / ``durable``). A
    restore that raises an error of its own records its point in ``ledger``."""
    lo = inputs.start_iteration - 1  # a point older than the --load checkpoint would only re-execute more
    own = plan.store if plan is not None and plan.store is not None else inputs.session.store
    rs = RecoveryState(fallback_iteration=inputs.start_iteration)
    point_end = lambda: rs.point.end if rs.point is not None else None  # noqa: E731
    recording(ledger, GLOBAL, point_end,
               lambda: _machine(inputs, BoundedStore(own, lo=lo, hi=below), rs,
                                check_routing=plan.check_routing if plan is not None else True))
    if rs.point is not None:
        return rs, "memory"
    durable = durable_store(inputs, newer_than=lo)
    if durable is None:
        return rs, "memory"
    store, complete_end = durable  # every node's memory tier lost the point: the durable tier is the last resort
    memory = rs
    rs = RecoveryState(fallback_iteration=inputs.start_iteration, skipped=list(memory.skipped))
    hi = complete_end if below is None else min(complete_end, below)
    recording(ledger, GLOBAL, point_end, lambda: _machine(inputs, BoundedStore(store, hi=hi), rs))
    rs.proposals = memory.proposals + rs.proposals
    rs.seconds = {k: memory.seconds.get(k, 0.0) + rs.seconds.get(k, 0.0) for k in {*memory.seconds, *rs.seconds}}
    if rs.point is None:  # the durable tier's points did not restore on every rank either: say so
        tier = durable_tier(inputs)
        assert tier is not None  # durable_store found its points
        rs.message = (f"the durable tier's complete points up to iteration {complete_end} in "
                      f"{tier.directory} did not restore on every rank (the lines above "
                      f"say why); {rs.message}")
        return rs, "memory"
    # the point restored: an older complete point when a newer one failed its checks on some rank
    passed = "" if rs.point.end == complete_end else \
        f" (the newer complete point ending at {complete_end} did not restore on every rank)"
    rs.message = (f"no recovery point in every rank's memory tier (node-local stores and replicas); "
                  f"recovered from the complete durable point ending at iteration {rs.point.end}{passed} in "
                  f"{os.path.dirname(store.backend.describe())}")
    return rs, "durable"


def report_skipped(inputs: RecoveryInputs, rs: RecoveryState) -> None:
    """Corrupt entries skipped while agreeing: logged by the rank that found them, listed in the report."""
    for line in rs.skipped:
        print(f"moe-ft recovery rank {inputs.rank}: {line}", file=sys.stderr, flush=True)
    gathered = comm.all_gather_object([f"rank {inputs.rank}: {m}" for m in rs.skipped])
    skipped = [m for part in gathered for m in part]
    if skipped:
        rs.message = "; ".join(filter(None, [rs.message, "corrupt entries skipped: " + "; ".join(skipped)]))


def account_token_loss(inputs: RecoveryInputs, point, durable: bool = False) -> dict:
    """Popularity as of the point (its FULL experts marked); for a lossy policy the lost-token metric of
    its paper per MoE layer, every expert's counters restarted at the FULL entry it was restored from (the
    tokens reported now are not reported again by a later recovery), and the policy's reaction (e.g.
    Dynamic-K). ``durable``: the point came from the durable tier."""
    loss = {"tokens": 0.0, "metric": None, "value": 0.0}
    if point is None:
        return loss
    policy, popularity = inputs.session.policy, inputs.popularity
    if not policy.lossy:  # exact: the policy's state of `end` (its metadata) plans `end` as it was
        plan = policy.plan(point.end, popularity)
        popularity.mark_full(point.end, [op for op, lvl in plan.items() if lvl == Level.FULL])
        return loss
    t, m = inputs.args.training, inputs.args.model
    tokens_per_iteration = t.global_batch_size * m.seq_length * m.moe_router_topk
    denom = torch.full((len(popularity.moe_layers),), policy.token_loss_denominator(
        point.end, train_iters=t.train_iters, tokens_per_iteration=tokens_per_iteration))
    expert_full_at = gather_expert_full_at(point.full_at)
    # the counters as recorded at `end`, before mark_full(end): since the last snapshot FULL, or since the
    # last persisted one where a durable point restores an expert from there
    since = popularity.since_entry(expert_full_at)
    loss = token_loss(end=point.end, expert_full_at=expert_full_at, since_entry=since,
                      moe_layers=popularity.moe_layers, metric=policy.token_loss_metric, tokens_per_layer=denom,
                      over_layers=policy.token_loss_layers)
    # The experts saved at `end` are those restored from an entry of `end`, not a plan of `end` made again:
    # selective's budget follows the iteration time measured before the failure (MoEtion §4.2), which the
    # restarted policy has not measured, and a durable point holds only the experts pec persisted (MoC §5.1).
    popularity.restored_from(expert_full_at, torch.tensor(loss["per_expert"], dtype=torch.float64), durable=durable)
    loss.update(policy.after_recovery(point.end, loss["value"]))
    return loss


def drop_abandoned_timeline(inputs: RecoveryInputs, rs: RecoveryState, rebuilt: bool = False) -> None:
    """Points after the resume point belong to a timeline that will not happen again (a lossy run differs
    from it); retention follows the restored policy's windows. After a CheckFree rebuild (``rebuilt``) every
    point goes (``RecoveryReport.timeline_kept_through``). Replicas, upstream logs and the durable tier drop
    theirs in the runtime's components (``after_recovery``)."""
    inputs.session.store.discard_after(-1 if rebuilt else rs.resume_iteration - 1)
    if rs.point is not None:
        inputs.session.realign_retention()


def build_report(inputs: RecoveryInputs, rs: RecoveryState, *, source: str, lost_through: int, fetched: dict,
                 loss: dict, seconds: dict) -> RecoveryReport:

    point, state = rs.point, inputs.state
    assert rs.phase is Phase.DONE
    return RecoveryReport(
        policy=inputs.session.name, restart_count=inputs.restart_count,
        failed={"last_completed": lost_through,
                "faults_fired": [str(f) for f in inputs.faults.fired()] if inputs.faults else []},
        recovery_point={"source": source, "start": point.start if point else inputs.start_iteration,
                        "end": point.end if point else inputs.start_iteration - 1, "resume": rs.resume_iteration,
                        "proposals": rs.proposals, **fetched},
        replayed_iterations=list(rs.replayed),
        reexecuted_iterations=list(range(rs.resume_iteration, lost_through + 1)),
        seconds=seconds, bytes_loaded=rs.bytes_loaded, token_loss=loss, routing_checked=rs.routing_checked,
        recovered_digest=global_digest(state.model, state.optimizer, state.scheduler), message=rs.message)


def record_recovery_levels(inputs: RecoveryInputs, plan, rs: RecoveryState, source: str, report: RecoveryReport) -> None:
    """The level each operator reached (report ``recovery_levels``, the job's audit log) and, on a rebuilt
    stage's rank, CheckFree's learning-rate boost (collective; refuses below ``--ft-min-recovery-level``)."""

    if plan.rebuilt is not None and rs.point is not None:
        boost_rebuilt_stage(inputs.state, rs.resume_iteration)
    levels = planner.record_levels(plan, rank=inputs.rank, ops=list(inputs.registry), rs=rs, source=source,
                                   lossy=inputs.session.policy.lossy, min_level=inputs.config.recovery.min_recovery_level,
                                   audit_path=audit_path(inputs), report=report,
                                   deterministic=inputs.args.training.deterministic)
    for r in levels["rebuilt"]:
        report.message = "; ".join(filter(None, [report.message, (
            f"rank {r['rank']} rebuilt by CheckFree from ranks {r['from']} (weights {r['weights'][0]:.3f}/"
            f"{r['weights'][1]:.3f}{', ' + r['note'] if r['note'] else ''}), learning rate x1.1")]))


