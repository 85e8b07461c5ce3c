"""The localized scope of a recovery as the driver runs it (``driver.py``): try it (``localized.py`` decides and
runs it, collective), and when it recovered the job, its report. A target that failed before is widened to the
global scope (``decisions.py``)."""

from __future__ import annotations

from moe_ft import comm
from moe_ft.digest import global_digest
from moe_ft.recovery import localized, planner
from moe_ft.recovery.decisions import recording
from moe_ft.recovery.inputs import RecoveryInputs, audit_path, discard_survivor_points, phase_seconds
from moe_ft.recovery.ledger import LOCALIZED, Avoided, DecisionLedger
from moe_ft.recovery.report import RecoveryReport
from moe_ft.recovery.schedule import ScheduleRule


def try_localized(inputs: RecoveryInputs, *, lost_through: int, since_fault: float | None, t0: float,
                  ledger: DecisionLedger | None = None, avoided: Avoided | None = None,
                  rule: ScheduleRule | None = None):
    """Localized recovery (``localized.py``, collective): ``(scope, report)`` when it recovered the job,
    ``(scope, None)`` when the global path must run (``scope.reason`` says why). A localized recovery to
    the same target failed before (``avoided``): the global path, saying so. ``rule``: the LR-schedule rule
    applied to the recovered state (``schedule.py``)."""

    if inputs.survivor is not None:
        inputs.survivor.forget()  # the live state is about to be rewritten
    scope = localized.decide(inputs)
    if not scope.localized:
        return scope, None
    if avoided is not None and scope.target in avoided.localized:
        why = avoided.localized[scope.target]
        scope.mode, scope.reason = "global", (f"a localized recovery to iteration {scope.target} failed before "
                                              f"({why}): widened to the global scope")
        return scope, None
    mine = recording(ledger, LOCALIZED, lambda: scope.target, lambda: localized.run(inputs, scope))
    if mine is None:
        if scope.rewrote_state and ledger is not None:  # a next attempt must not try it again (see recover)
            ledger.record(LOCALIZED, scope.target, scope.reason)
        return scope, None
    outcomes = mine.pop("outcomes")
    if rule is not None:  # every rank holds the state of the target now (the replaying ranks' lost iterations too)
        rule.after_restore(inputs.state)
    inputs.session.store.discard_after(scope.target)
    inputs.session.realign_retention()
    return scope, build_localized_report(inputs, scope, mine, outcomes, lost_through=lost_through,
                                         since_fault=since_fault, t0=t0)


def build_localized_report(inputs: RecoveryInputs, scope, mine: dict, outcomes: list[dict], *, lost_through: int,
                           since_fault: float | None, t0: float) -> RecoveryReport:

    state = inputs.state
    replayed = planner.replay_source(inputs.args.training.deterministic)
    source = "survivor_point" if mine["role"] == "load" else replayed
    levels = planner.summarize(comm.all_gather_object({str(op): source for op in inputs.registry}))
    levels.update(path="localized", planned=planner.SOURCE_LEVEL[replayed], reason=scope.reason,
                  min_level=inputs.config.recovery.min_recovery_level, unavailable={}, rebuilt=[])
    seconds = phase_seconds(mine["seconds"], t0, since_fault)
    slowest = {key: max((o["seconds"].get(key, 0.0) for o in outcomes), default=0.0) for key in ("load", "replay_total")}
    seconds["replay"] = round(slowest["replay_total"], 4)  # the replaying stage's, whichever rank reports
    seconds["restore"] = round(max(seconds["restore"], slowest["load"]), 4)
    window = mine.get("window") or [scope.target, scope.target]
    report = RecoveryReport(
        policy=inputs.session.name, restart_count=inputs.restart_count,
        failed={"last_completed": lost_through,
                "faults_fired": [str(f) for f in inputs.faults.fired()] if inputs.faults else []},
        recovery_point={"source": "survivor" if mine["role"] == "load" else "memory", "start": window[0],
                        "end": scope.target, "resume": scope.target + 1, "proposals": []},
        replayed_iterations=list(mine["replayed"]),
        reexecuted_iterations=list(range(scope.target + 1, lost_through + 1)),
        seconds=seconds, bytes_loaded=mine["bytes_loaded"],
        token_loss={"tokens": 0.0, "metric": None, "value": 0.0},
        recovered_digest=global_digest(state.model, state.optimizer, state.scheduler), message=scope.reason,
        recovery_levels=levels,
        scope={**scope.to_json(),
               "replayed": {str(o["rank"]): o["replayed"] for o in outcomes if o["role"] == "replay"},
               "loaded": [o["rank"] for o in outcomes if o["role"] == "load"],
               "log_bytes_read": {str(o["rank"]): o["log_bytes"] for o in outcomes if o["role"] == "replay"},
               "bytes_loaded": {str(o["rank"]): o["bytes_loaded"] for o in outcomes},
               "seconds": {str(o["rank"]): o["seconds"] for o in outcomes},
               "stage_iterations_replayed": sum(len(o["replayed"]) for o in outcomes if o["role"] == "replay")})
    if inputs.rank == 0:
        planner.append_audit(audit_path(inputs), {"restart_count": report.restart_count, "policy": report.policy,
                                                  "resume": scope.target + 1, **levels})
    discard_survivor_points(inputs)
    return report
