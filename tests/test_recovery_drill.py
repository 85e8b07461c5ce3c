"""Failure drills: real processes are SIGKILLed by the deterministic fault plan (``--ft-fail``),
torchrun restarts the job (``--max-restarts``), the job recovers from the node-local store and finishes.

Exact policies (``sparse``, ``dense(k)``): the final training-state digest equals a fault-free run's
bitwise. One fault-free reference per layout (the session's ``fault_free_digest``, built lazily) serves every
faulty run of that layout; each faulty run carries several faults so that one launch exercises several paths (a kill inside a
window, during a snapshot copy, during store publish, during replay, a corrupted store entry).

Lossy policies (``pec``, ``selective``): the reported PLT/MLT equals the token loss recomputed here from the
per-iteration popularity counters (``--ft-trace-out``), and Dynamic-K doubles K past 3.75 % PLT.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from moe_ft.cli.drill import run_job
from moe_ft.drills.launchers import default_launcher
from moe_ft.persist.validate import validate_durable
from tests._ft_helpers import check_restart_kind, wait_until

pytestmark = pytest.mark.multiproc

# 10 iterations: the fault-free references are the session's, shared with the node drills (which need 10)
ITERS, WINDOW = 10, 3
LOSSY_ITERS = 8  # the lossy drills' token-loss denominators (Dynamic-K's threshold) are tuned to 8
# tiny job: global batch 8 x seq 32 tokens, top-2 routing (moe_ft/cli/drill.py TINY)
TOPK_TOKENS = 8 * 32 * 2


@pytest.fixture(scope="module")
def drill_env(corpus, tmp_path_factory):
    return {"data": corpus, "work": str(tmp_path_factory.mktemp("drill")),
            "store": str(tmp_path_factory.mktemp("drill_store"))}


@pytest.fixture(scope="module")
def reference(fault_free_digest):
    """``reference(layout)`` → digest of the fault-free run of that layout (run once per session, on demand)."""
    return lambda layout: fault_free_digest(layout, ITERS)


def launch(env, job, *, layout, policy, faults=(), extra=(), max_restarts=0, timeout=300, iters=ITERS, launcher=None):
    return run_job(job=job, workdir=env["work"], faults=list(faults), max_restarts=max_restarts, timeout=timeout,
                   launcher=launcher,
                   layout=layout, policy=policy, iters=iters, data=env["data"], store=env["store"],
                   window=WINDOW, extra=list(extra))


def check_exact_reports(reports, *, ends: dict[int, int], fired: list[str], launcher: str | None = None):
    """``ends``: restart count → restored iteration of that restart's (completed) recovery; ``fired``: the
    faults in firing order (one per restart). Every recovery restored a point from memory, replayed exactly
    the window's iterations after its start and re-executed exactly the iterations lost after the point."""
    assert {r["restart_count"]: r["recovery_point"]["end"] for r in reports} == ends, reports
    for r in reports:
        rp = r["recovery_point"]
        assert rp["source"] == "memory" and rp["resume"] == rp["end"] + 1
        assert r["replayed_iterations"] == list(range(rp["start"] + 1, rp["end"] + 1))
        assert r["reexecuted_iterations"] == list(range(rp["resume"], r["failed"]["last_completed"] + 1))
        assert r["routing_checked"] == len(r["replayed_iterations"])
        assert r["token_loss"]["tokens"] == 0.0
        assert set(r["failed"]["faults_fired"]) == set(fired[: r["restart_count"]])
        assert {"agree", "load", "finalize", "total"} <= set(r["seconds"])
        check_restart_kind(r, launcher)


@pytest.mark.timeout(600)
def test_sparse_ep2pp2_publish_and_replay_kills(drill_env, reference):
    """Kill rank 1 while it publishes iteration 5 (window [3, 5] never completes on it: back to [0, 2]),
    then rank 2 while it replays iteration 2 (a cascading failure during recovery). The node agent hashes
    every published point (``--ft-checksum-by agent``: the trainers write each byte once) and writes the
    durable tier."""
    faults = ["1:5:publish", "2:2:recovery"]
    durable = os.path.join(drill_env["work"], "sparse_ep2pp2_durable")
    res = launch(drill_env, "sparse_ep2pp2", layout="ep2pp2", policy="sparse", faults=faults, max_restarts=2,
                 extra=["--ft-persist-interval", "3", "--ft-persist-dir", durable, "--ft-persist-agent",
                        "--ft-persist-agent-idle-exit", "60", "--ft-checksum-by", "agent", "--ft-log-interval", "1"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == reference("ep2pp2")
    log = Path(res["log"]).read_text()
    assert re.search(r"agent verified [1-9]\d* points", log) and "is not verified yet" not in log, log[-3000:]
    verified = sorted(Path(drill_env["store"], "sparse_ep2pp2").glob("rank*/verified/*.json"))
    assert verified and all(json.loads(p.read_text())["digests"] for p in verified)
    # the node agent wrote the durable tier across both recoveries (each rank's pending copies settled
    # before the abandoned timeline was discarded): its newest complete point verifies and holds every expert
    end, problems = validate_durable(os.path.join(durable, "moe_ft", "sparse_ep2pp2"), num_layers=2, num_experts=4)
    assert problems == [] and end == ITERS - 2, (end, problems)  # window [6, 8]: persisted at 8 (interval 3)
    from moe_ft.persist import DurableTier
    from moe_ft.store.codec import PENDING

    tier = DurableTier(durable, "sparse_ep2pp2", 4)  # the agent hashed each point before it copied it
    assert all(e.checksum != PENDING for r in range(4) for p in tier.store(r).catalog().points()
               for e in p.all_entries())
    agent_log = Path(drill_env["store"], "sparse_ep2pp2", "agent", "agent.log")
    wait_until(lambda: "exiting (every rank said bye)" in agent_log.read_text(), timeout=30, message=agent_log.read_text())
    if default_launcher().startswith("inprocess"):  # moe-ft launch starts the node agent before the workers
        assert "(started by moe-ft launch)" in agent_log.read_text(), agent_log.read_text()
    # restart 1's recovery was killed while replaying (no report); restart 2 redid it from [0, 2]
    check_exact_reports(res["reports"], ends={2: 2}, fired=[f + ":exit" for f in faults])
    (report,) = res["reports"]
    assert report["replayed_iterations"] == [1, 2] and report["failed"]["last_completed"] >= 4
    assert "moe-ft fault injection: rank 2 fails at iteration 2 (recovery, exit)" in Path(res["log"]).read_text()


@pytest.mark.timeout(600)
def test_a_recovery_that_failed_on_its_own_is_not_repeated(drill_env, reference):
    """Rank 3 is killed at iteration 7; the recovery restores window [3, 5] and rank 1's replay of
    iteration 5 raises an error of its own (not a dead peer). The next recovery does not restore point 5
    again: it takes an older one, says which decision it avoided and why, and the job ends bitwise equal to
    the fault-free run."""
    res = launch(drill_env, "avoid_failed", layout="ep2pp2", policy="sparse", max_restarts=2,
                 faults=["3:7:backward", "1:5:recovery:exception"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == reference("ep2pp2")
    report = res["reports"][-1]
    avoided = report["scope"]["avoided"]["global"]
    (failed_point,) = (int(p) for p in avoided)
    assert "InjectedFault" in avoided[str(failed_point)] and failed_point == 5
    assert report["recovery_point"]["end"] < failed_point and report["recovery_point"]["source"] == "memory"
    assert "not repeated, it failed before: restoring point" in report["message"]


@pytest.mark.timeout(600)
def test_sparse_dp2ep2_kill_during_snapshot_copy(drill_env, reference):
    """DP=2 x EP=2 (distributed optimizer): kill rank 0 with the copy of iteration 4 in flight (inside
    window [3, 5]): back to [0, 2], replay 1 and 2, re-execute 3 … the last completed iteration. (The
    dense(k) test below kills a DP2 x EP2 rank at the start of an iteration.) Launched by plain torchrun
    (fresh interpreters) against the reference the preloaded launcher ran: the launcher changes nothing."""
    faults = ["0:4:snapshot"]
    res = launch(drill_env, "sparse_dp2ep2", layout="dp2ep2", policy="sparse", faults=faults, max_restarts=1,
                 launcher="torchrun")
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == reference("dp2ep2")
    check_exact_reports(res["reports"], ends={1: 2}, fired=[f + ":exit" for f in faults], launcher="torchrun")
    assert res["reports"][0]["replayed_iterations"] == [1, 2]
    assert res["reports"][0]["reexecuted_iterations"][0] == 3


@pytest.mark.timeout(600)
def test_dense_k_exact_and_corrupt_entry_skipped(drill_env, reference):
    """dense(k=3) points at 0, 3, 6. Rank 1 dies at the start of 5: restore 3, re-execute 4 only. Later
    rank 2 corrupts its published point 6 and dies: the corrupt entry is detected and skipped (reason in
    the log and the report), the job agrees on 3 again and still ends bitwise equal to the fault-free run
    (taking snapshots never changes the training state, so the sparse reference applies)."""
    faults = ["1:5:forward", "2:6:published:corrupt"]
    res = launch(drill_env, "dense_dp2ep2", layout="dp2ep2", policy="dense", faults=faults, max_restarts=2,
                 extra=["--ft-dense-interval", "3"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == reference("dp2ep2")
    first, second = res["reports"]
    check_exact_reports(res["reports"], ends={1: 3, 2: 3}, fired=["1:5:forward:exit", "2:6:published:corrupt"])
    assert first["reexecuted_iterations"] == [4] and first["replayed_iterations"] == []
    assert second["replayed_iterations"] == [] and len(second["reexecuted_iterations"]) >= 3
    assert "corrupt entries skipped: rank 2:" in second["message"] and "iteration 6" in second["message"]
    log = Path(res["log"]).read_text()
    assert "corrupted" in log and "moe-ft recovery rank 2: " in log and "skipping iteration 6" in log


def expected_loss(trace_path: str, end: int, denominator: float, over_layers: str) -> tuple[float, float, list[float]]:
    """Tokens routed to each expert after its newest FULL at or before ``end`` (the first incarnation's
    per-iteration counters), and their per-layer fractions of ``denominator``, averaged (PLT, MoC eq. 7)
    or summed (MLT, MoEtion eq. 6) over the layers."""
    first: dict[int, dict] = {}
    for line in Path(trace_path).read_text().splitlines():
        rec = json.loads(line)
        first.setdefault(rec["iteration"], rec)
    assert set(range(end + 1)) <= set(first), "the trace misses iterations before the recovery point"
    num_layers, num_experts = len(first[0]["counts"]), len(first[0]["counts"][0])
    per_layer = []
    total = 0.0
    for layer in range(num_layers):
        lost = 0.0
        for expert in range(num_experts):
            fulls = [t for t in range(end + 1) if [layer, expert] in first[t]["full_experts"]]
            newest = fulls[-1] if fulls else -1
            lost += sum(first[t]["counts"][layer][expert] for t in range(newest + 1, end + 1))
        per_layer.append(lost / denominator)
        total += lost
    return total, sum(per_layer) / (num_layers if over_layers == "mean" else 1), per_layer


@pytest.mark.timeout(420)
@pytest.mark.parametrize("policy,layout", [("pec", "ep2pp2"), ("selective", "dp2ep2")])
def test_lossy_token_loss_matches_counters(drill_env, policy, layout):
    """Rank 1 dies at the start of iteration 7; each expert restarts from its newest FULL entry. The
    report's PLT (pec, over the whole run's tokens, MoC eq. 7) or MLT (selective, over the tokens so far,
    MoEtion eq. 6) equals the loss recomputed from the counters; pec's Dynamic-K doubles K past 3.75 %."""
    trace = str(Path(drill_env["work"]) / f"trace_{policy}.jsonl")
    # selective: ~210 kB of non-expert FULL state per rank + room for one or two ~50 kB experts, so most
    # experts are stale at any time (the default budget, bandwidth x iteration time, saves them all)
    extra = ["--ft-trace-out", trace] + (["--ft-pec-k", "1"] if policy == "pec" else
                                         ["--ft-selective-local-budget", "320000"])
    # iteration 7: the snapshots of 0 … 5 are published everywhere (a kill at 6 can catch rank 1 still
    # publishing 5, and an expert whose first FULL is at 5 would leave no in-memory point at all)
    res = launch(drill_env, f"lossy_{policy}", layout=layout, policy=policy, faults=["1:7:forward"],
                 max_restarts=1, extra=extra, iters=LOSSY_ITERS)
    assert res["rc"] == 0, res["log"]
    (report,) = res["reports"]
    end = report["recovery_point"]["end"]
    assert report["recovery_point"]["source"] == "memory", report["recovery_point"]
    assert report["replayed_iterations"] == [] and report["recovery_point"]["resume"] == end + 1
    denominator = (LOSSY_ITERS if policy == "pec" else end + 1) * TOPK_TOKENS
    tokens, value, per_layer = expected_loss(trace, end, denominator, "mean" if policy == "pec" else "sum")
    loss = report["token_loss"]
    assert loss["metric"] == ("PLT" if policy == "pec" else "MLT")
    assert tokens > 0 and loss["tokens"] == tokens
    assert loss["per_layer"] == pytest.approx(per_layer, rel=1e-12)
    assert loss["value"] == pytest.approx(value, rel=1e-12)
    if policy == "pec":
        assert value > 0.0375, "the drill should cross the Dynamic-K threshold"
        assert loss["k_before"] == 1 and loss["k_after"] == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scope", ["localized", "global"])
def test_a_replay_without_determinism_is_reported_below_exact(drill_env, scope):
    """``--no-deterministic``: a replay runs the same iterations on the same data, but on GPU its kernels may
    give other bits than the run that failed, so the report says ``nondeterministic``, not ``exact`` (whatever
    this CPU computes: the report cannot tell). Localized: the replaying stage's operators;
    global: the operators the window replay computed (an operator FULL at the point's end stays exact)."""
    res = run_job(job=f"nondeterministic_{scope}", workdir=drill_env["work"], faults=["2:5"], max_restarts=1,
                  timeout=300, layout="ep2pp2", policy="sparse", iters=ITERS, data=drill_env["data"],
                  store=drill_env["store"], window=WINDOW, extra=["--no-deterministic"], scope=scope)
    assert res["rc"] == 0, f"see {res['log']}"
    (report,) = res["reports"]
    assert report["scope"]["mode"] == scope, report["scope"]["reason"]
    levels = report["recovery_levels"]
    assert levels["level"] == "nondeterministic" and levels["sources"].get("nondeterministic_replay"), levels
    assert set(levels["sources"]) <= {"nondeterministic_replay", "survivor_point", "window_replay"}, levels
    assert "| level nondeterministic (" in Path(res["log"]).read_text()
