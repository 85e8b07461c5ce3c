"""Rebalance expert replicas inside the running job (Lazarus §4.3, §5).

4 ranks, DP2 x EP2, flexible dispatcher, replicas 3 1 2 2 on 4 slots per EP rank, sparse snapshots (window
3), ``--ft-elastic --ft-rebalance-interval 4``: after iterations 3, 7, 11 and 15 every layer is re-planned
from the recent loads and only the experts a rank gains move.

* the rebalance is real and changes no value: the loads drift, so replicas move; the final parameters equal
  those of the same run without rebalancing up to float summation order (which replica serves which token
  changes; the printed maximum is ~1e-7), so no moved expert arrived with wrong state;
* recovery across rebalances is exact (bitwise digest equal to the fault-free rebalancing run): rank 1 is
  killed at iteration 9 (recovers from the dense point of the new plan at 7), rank 2 at 14 (the dense point
  at 11, two iterations re-executed), and rank 1 once more inside the snapshot of iteration 19 -- right
  after the rebalance at 19 moved states, before the layout record names the new plans: the restart builds
  the old plans, recovers from their window and rebalances again the same way;
* the final ``--save`` checkpoint (spare slots under optional keys) loads into a new job that starts from
  the flags' plan, and training goes on.
"""

from __future__ import annotations

import glob
import json
import math

import pytest

pytestmark = pytest.mark.multiproc

ITERS, WINDOW, INTERVAL = 22, 3, 4
FLEXIBLE = ["--ft-replicas", "0", "--ft-expert-replicas", "3", "1", "2", "2", "--ft-expert-slots", "4", "--ft-elastic"]
PARAM_BOUND = 1e-4
"""Largest |parameter difference| with vs without rebalancing after 22 iterations (observed: printed)."""


def _run(corpus, tmp_path, job, extra, faults=(), iters=ITERS):
    from moe_ft.cli.drill import run_job

    return run_job(job=job, workdir=str(tmp_path), timeout=400, store=str(tmp_path / f"{job}_store"),
                   layout="dp2ep2-flexible", policy="sparse", iters=iters, data=corpus, window=WINDOW,
                   faults=list(faults), max_restarts=len(faults), extra=[*FLEXIBLE, *extra])


@pytest.mark.timeout(900)
def test_rebalance_in_the_run_moves_state_exactly_and_recovers_bitwise(corpus, tmp_path):
    from moe_ft.drills.report import load_parameters, param_deviation

    plain = _run(corpus, tmp_path, "plain", [])
    assert plain["rc"] == 0, f"see {plain['log']}"
    every = ["--ft-rebalance-interval", str(INTERVAL)]
    ckpt = str(tmp_path / "ckpt")
    ref = _run(corpus, tmp_path, "ref", [*every, "--save", ckpt])
    assert ref["rc"] == 0 and ref["digest"], f"see {ref['log']}"
    (history_file,) = glob.glob(str(tmp_path / "ref_store" / "ref" / "reports" / "rebalance_rank0_*.json"))
    history = json.loads(open(history_file).read())
    assert [h["iteration"] for h in history] == [3, 7, 11, 15, 19]
    moved = [h for h in history if h["changed"]]
    # a change of replica counts that every rank can serve from what it holds moves nothing (only the
    # dispatch shares change); an expert a rank gains arrives from a holder, on every DP replica
    assert any(h["fetches"] > 0 for h in moved), history
    for h in moved:
        assert (h["experts_moved"] > 0) == (h["fetches"] > 0) == (h["bytes_moved"] > 0), h
    for h in moved:  # every expert keeps a replica, every slot is filled
        for rows in h["plans"].values():
            assert all(sum(row) >= 1 for row in rows) and [sum(col) for col in zip(*rows)] == [4, 4], rows
    log = open(ref["log"]).read()
    assert "moe-ft rebalance: after iteration 3:" in log

    paths = lambda job: sorted(glob.glob(str(tmp_path / f"{job}.json.params_rank*.pt")))  # noqa: E731
    dev = param_deviation(load_parameters(paths("plain")), load_parameters(paths("ref")))
    print(f"rebalance vs none: max |param diff| {dev['max_abs_param_diff']:.3g} ({dev['worst_param']})")
    assert math.isfinite(dev["max_abs_param_diff"]) and dev["max_abs_param_diff"] <= PARAM_BOUND

    faulty = _run(corpus, tmp_path, "faulty", every, faults=["1:9", "2:14", "1:19:snapshot"])
    assert faulty["rc"] == 0, f"see {faulty['log']}"
    assert faulty["digest"] == ref["digest"], "recovery across rebalances must be exact"
    points = [r["recovery_point"] for r in faulty["reports"]]
    assert [(p["start"], p["end"]) for p in points[:2]] == [(7, 7), (11, 11)], points  # the dense points
    assert points[2]["end"] < 19, "the new plans were not recorded yet: the old plans' point serves"

    # the checkpoint written under a rebalanced plan (spare slots included) loads into a job that starts
    # from the flags' plan: the spare slots the checkpoint lacks keep their values, training goes on
    resumed = _run(corpus, tmp_path, "resumed", [*every, "--load", ckpt, "--use-checkpoint-opt-param-scheduler"],
                   iters=ITERS + 2)  # two more iterations on the checkpoint's LR schedule
    assert resumed["rc"] == 0, f"see {resumed['log']}"
    log = open(resumed["log"]).read()
    assert "Missing key" not in log and f"iteration     {ITERS + 2}/{ITERS + 2} | loss" in log, log[-2000:]
