"""Localized recovery end to end under torchrun (PP=4 on 4 ranks, 1F1B, sparse
snapshots). Real processes are SIGKILLed by the fault plan; the survivors publish their state (survivor
points), torchrun restarts the job, only the failed stages replay their window from their neighbours'
logs, the survivors load, and the final training-state digest equals the fault-free run's bitwise.

One fault-free reference serves every faulty launch; each launch carries a cascade of faults so that few
launches cover: one stage lost mid-window and killed again during its replay; two adjacent stages lost at
once and a survivor lost while they replay (it loads its kept point again); a survivor killed during its
dump (a failed rank: its stage replays too); a loss before the optimizer
step (localized) and one after it (every survivor inside its update: global); the global scope on the same
fault (the fallback path, also bitwise); and EP2 x PP2, where a stage is two ranks that replay together."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_ft.cli.drill import run_job
from moe_ft.drills.launchers import default_launcher
from tests._ft_helpers import check_restart_kind

pytestmark = pytest.mark.multiproc

ITERS, WINDOW = 8, 3


@pytest.fixture(scope="module")
def env(corpus, tmp_path_factory):
    return {"data": corpus, "work": str(tmp_path_factory.mktemp("localized")),
            "store": str(tmp_path_factory.mktemp("localized_store"))}


def launch(env, job, faults=(), scope="localized", max_restarts=0, extra=()):
    return run_job(job=job, workdir=env["work"], faults=list(faults), max_restarts=max_restarts, timeout=400,
                   layout="pp4", policy="sparse", iters=ITERS, data=env["data"], store=env["store"], window=WINDOW,
                   extra=list(extra), scope=scope)


@pytest.fixture(scope="module")
def reference(fault_free_digest):
    """The digest of the fault-free PP=4 run (shared by the session)."""
    return fault_free_digest("pp4", ITERS)


def only_report(res) -> dict:
    assert res["rc"] == 0 and res["digest"], f"faulty run failed (rc {res['rc']}), see {res['log']}"
    (report,) = res["reports"]  # the interrupted recoveries wrote none
    return report


def check_localized(report, *, replaying, stages, replayed_through):
    sc = report["scope"]
    assert sc["mode"] == "localized", sc["reason"]
    assert sc["replaying"] == replaying and sc["failed_stages"] == stages
    assert sorted(sc["loaded"]) == sorted(set(range(4)) - set(replaying))
    assert sorted(sc["replayed"]) == [str(r) for r in replaying]
    for r in replaying:  # the window's iterations after its start, then the lost ones, up to the target
        its = sc["replayed"][str(r)]
        assert its == list(range(its[0], sc["target"] + 1)) and its[-1] == replayed_through
        assert sc["log_bytes_read"][str(r)] > 0
    assert sc["stage_iterations_replayed"] == sum(len(v) for v in sc["replayed"].values())
    levels = report["recovery_levels"]
    assert levels["path"] == "localized" and levels["level"] == "exact"
    assert set(levels["sources"]) == {"survivor_point", "window_replay"}
    assert report["recovery_point"]["resume"] == sc["target"] + 1
    assert report["reexecuted_iterations"] == []  # the target is the newest completed iteration
    check_restart_kind(report)


@pytest.mark.timeout(420)
def test_one_stage_lost_then_killed_again_during_its_replay(env, reference):
    """Stage 2 SIGKILLed at the start of iteration 5 (mid-window); after the restart it is SIGKILLed again
    while replaying iteration 3; the survivors, waiting, publish their state once more."""
    res = launch(env, "stage2", faults=["2:5", "2:3:recovery"], max_restarts=3)
    report = only_report(res)
    assert res["digest"] == reference, "localized recovery is not bitwise equal to the fault-free run"
    assert report["restart_count"] == 2 and len(report["failed"]["faults_fired"]) == 2
    check_localized(report, replaying=[2], stages=[2], replayed_through=4)
    assert report["scope"]["components"] == [[2]]
    assert report["recovery_point"]["source"] == "survivor"  # rank 0 only loaded
    log = Path(res["log"]).read_text()
    kept = log.count("published its state at iteration 4") + log.count("holds its state in memory at iteration 4")
    assert kept >= 6  # 3 survivors, twice (held in memory under moe-ft launch, else published)


@pytest.mark.timeout(420)
def test_adjacent_stages_lost_together_and_a_survivor_lost_during_their_replay(env, reference):
    """Stages 1 and 2 SIGKILLed together: they replay jointly (one component). Stage 0, a survivor, is
    SIGKILLed while loading its point in that recovery. Under torchrun its published point outlives the
    process (tmpfs), so the next recovery has the same scope and stage 0 loads it again; under moe-ft launch
    the survivors hold their points in memory, so stage 0's died with it and stage 0 replays too."""
    res = launch(env, "adjacent", faults=["1:5", "2:5", "0:4:recovery"], max_restarts=3)
    report = only_report(res)
    assert res["digest"] == reference
    # 2 attempts, or 3 when the launcher saw the two kills of iteration 5 in two polls (a loaded machine):
    # either way each kill fired once and the last recovery replays the same component
    assert report["restart_count"] in (2, 3) and len(report["failed"]["faults_fired"]) == 3
    replaying = [0, 1, 2] if default_launcher().startswith("inprocess") else [1, 2]
    check_localized(report, replaying=replaying, stages=replaying, replayed_through=4)
    assert report["scope"]["components"] == [replaying]
    assert report["scope"]["log_bytes_read"].keys() == {str(r) for r in replaying}


@pytest.mark.timeout(420)
def test_a_survivor_killed_during_its_dump_is_a_failed_rank(env, reference):
    """Stage 2 SIGKILLed at the start of iteration 5; stage 1, stopped by the failure, is SIGKILLed half-way
    through writing its survivor point of iteration 4. Nothing of that dump is visible (atomic publish), so
    stage 1 counts as failed: stages 1 and 2 replay jointly, stages 0 and 3 load; bitwise."""
    res = launch(env, "torn_dump", faults=["2:5", "1:4:survivor"], max_restarts=2)
    report = only_report(res)
    assert res["digest"] == reference
    assert len(report["failed"]["faults_fired"]) == 2
    check_localized(report, replaying=[1, 2], stages=[1, 2], replayed_through=4)


@pytest.mark.timeout(420)
def test_global_scope_on_the_same_failure(env, reference):
    """``--ft-recovery-scope global``: every rank replays (the fallback path), still bitwise; the report
    says why survivor points were not used."""
    res = launch(env, "global", faults=["2:5"], scope="global", max_restarts=2)
    report = only_report(res)
    assert res["digest"] == reference
    assert report["scope"]["mode"] == "global" and report["scope"]["reason"] == "--ft-recovery-scope global"
    assert report["recovery_levels"]["unavailable"]["survivor_point"] == "not used: --ft-recovery-scope global"
    assert report["replayed_iterations"]  # rank 0 replayed too


@pytest.mark.timeout(420)
def test_lost_in_backward_is_localized_lost_in_step_falls_back(env, reference):
    """Stage 2 SIGKILLed right before its optimizer step of iteration 5: the survivors are waiting in the
    grad-norm all-reduce, before any of their state changed, and publish iteration 4 (localized). Later
    stage 1 is SIGKILLed after its optimizer step of iteration 6, while the others all-reduce the popularity
    counters after theirs: every survivor is inside its update, nobody publishes, the recovery is global."""
    res = launch(env, "phases", faults=["2:5:backward", "1:6:step"], max_restarts=3)
    assert res["rc"] == 0 and res["digest"] == reference, f"see {res['log']}"
    first, second = res["reports"]
    check_localized(first, replaying=[2], stages=[2], replayed_through=4)
    assert second["scope"]["mode"] == "global"
    assert "no rank published a survivor point" in second["scope"]["reason"]
    assert "inside the optimizer step" in Path(res["log"]).read_text()


@pytest.mark.timeout(420)
def test_expert_parallel_stage_replays_as_a_group(env, fault_free_digest):
    """EP2 x PP2 (ranks 2 and 3 form stage 1): rank 3 SIGKILLed; its EP peer, a survivor, replays with it
    (their all-to-alls run for real), stage 0 loads; bitwise equal to the fault-free EP2 x PP2 run (10
    iterations: the session's reference, shared with the other drills)."""
    iters = 10

    def run(job, faults, max_restarts):
        return run_job(job=job, workdir=env["work"], faults=faults, max_restarts=max_restarts, timeout=400,
                       layout="ep2pp2", policy="sparse", iters=iters, data=env["data"], store=env["store"],
                       window=WINDOW, extra=[], scope="localized")

    res = run("ep_bad", ["3:5"], 2)
    report = only_report(res)
    assert res["digest"] == fault_free_digest("ep2pp2", iters)
    sc = report["scope"]
    assert sc["mode"] == "localized" and sc["failed"] == [3] and sc["replaying"] == [2, 3]
    assert sc["loaded"] == [0, 1] and sc["replayed"]["2"] == sc["replayed"]["3"] == [1, 2, 3, 4]


@pytest.mark.timeout(420)
def test_a_corrupt_log_then_a_loss_during_the_global_fallback(env, reference):
    """Stage 2 dies at iteration 6 after damaging the newest upstream-log entry its replay needs: the
    localized replay finds it corrupt and every rank takes the global path. Rank 0 is killed right after
    that path rewrote the live state: the loaders had adopted the localized target, and no rank may keep
    that label for the rewritten state (none holds or publishes anything then). The next recovery ends
    bitwise equal to the fault-free run."""
    res = launch(env, "corrupt_log", faults=["2:6:forward:corrupt-log", "0:6:fallback"], max_restarts=3)
    report = only_report(res)
    assert res["digest"] == reference
    assert report["scope"]["mode"] == "global" and "failed verification" in report["scope"]["reason"], report["scope"]
    log = Path(res["log"]).read_text()
    after = log[log.index("rank 0 fails at iteration 6 (fallback"):]
    kept = [line for line in after.splitlines() if line.startswith("moe-ft survivor")][:3]
    assert len(kept) == 3 and all("published nothing" in line for line in kept), kept


@pytest.mark.timeout(420)
def test_a_replay_longer_than_the_distributed_timeout(env, reference):
    """``--distributed-timeout-minutes 0.1`` (6 s): stage 2, SIGKILLed at iteration 6, replays its window with
    slow steps (3 s each, ``slow`` faults): longer than the timeout in all. The loading ranks wait on the
    replay's progress in the store, not in one collective bounded by the timeout: localized, bitwise."""
    slow = [f"2:{it}:recovery:slow" for it in range(1, 6)]
    res = launch(env, "slow_replay", faults=["2:6", *slow], max_restarts=2, extra=["--distributed-timeout-minutes", "0.1"])
    report = only_report(res)
    assert res["digest"] == reference
    check_localized(report, replaying=[2], stages=[2], replayed_through=5)
    waits = [report["scope"]["seconds"][str(r)]["wait_replay"] for r in (0, 1, 3)]
    assert min(waits) > 6.0, waits  # the loaders waited longer than the group timeout, and got there
