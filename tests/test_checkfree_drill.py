"""CheckFree end to end: a whole pipeline stage is lost with every copy of its state.

PP=4 on 4 ranks, run as 4 simulated nodes of one rank each (``moe_ft/drills/cluster.py``), so rank r is
pipeline stage r. Node 1 is killed at the start of iteration 6 and its store deleted; there are no
replicas (``--ft-replicas 0``) and no durable tier, so nothing anywhere holds stage 1's state.

* accepted (``--ft-min-recovery-level approximate``): the planner takes the CheckFree path, rank 1 is
  rebuilt from ranks 0 and 2 weighted by their recorded squared gradient norms, every rank replays the
  survivors' window with the rebuilt stage, and training runs to the end; the report and the audit log
  label stage 1's operators ``checkfree`` (approximate);
* the rebuilt rank 1 fails once more at iteration 11 (its process only: its new store holds a complete
  window started after the rebuild -- [6, 8] when training resumed at 6 -- published at least two
  iterations before the kill, also on a loaded machine where publication lags); that exact recovery keeps its 1.1x learning rate (the per-group learning rates recorded with
  its snapshots are put back before the replay): its snapshots after both recoveries record the boosted
  ``max_lr`` / ``min_lr``;
* refused (``--ft-min-recovery-level exact``): the same loss stops the job with one line, before anything
  is restored.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from moe_ft.checkfree.lr_boost import GROUP_LR
from moe_ft.cli.drill import run_node_job
from moe_ft.drills.cluster import NodeLoss
from moe_ft.store import StoreConfig

pytestmark = pytest.mark.multiproc

ITERS, WINDOW = 12, 3
PP4 = ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "1", "--num-layers", "4",
       "--ft-replicas", "0", "--ft-ranks-per-node", "1"]


def lose_stage_1(corpus: str, work: Path, job: str, min_level: str, max_restarts: int, faults=(),
                 scope: str = "global") -> dict:
    workdir = work / job
    workdir.mkdir(parents=True)
    return run_node_job(job=job, workdir=str(workdir), faults=list(faults), losses=[NodeLoss.parse("1:6")], num_nodes=4,
                        max_restarts=max_restarts, timeout=500, layout="ep2pp2", policy="sparse", iters=ITERS,
                        data=corpus, store=str(work / f"{job}_store"), window=WINDOW,
                        extra=[*PP4, "--ft-min-recovery-level", min_level, "--ft-recovery-scope", scope])


@pytest.mark.timeout(600)
def test_lost_stage_rebuilt_by_checkfree(corpus, tmp_path):
    res = lose_stage_1(corpus, tmp_path, "accepted", "approximate", max_restarts=3, faults=["1:11"])
    assert res["rc"] == 0 and res["digest"], f"the drill failed (rc {res['rc']}), see {res['logs']}"
    (event,) = res["node_losses"]
    assert event["nodes"] == [1] and event["survivors"] == [0, 2, 3]
    # the audit log (rank 0's job directory, node 0 survived) has both recoveries, and so do the report
    # files (both recoveries ran at torchrun restart count 1: recovery_001.json, recovery_001_1.json)
    audit = Path(tmp_path / "accepted_store" / "node0" / "accepted" / "recovery_audit.jsonl").read_text().splitlines()
    levels, later_levels = (json.loads(line) for line in audit)
    first, later = res["reports"]
    assert first["recovery_levels"]["level"] == "approximate"
    assert levels["path"] == "checkfree" and levels["level"] == "approximate", levels
    (rebuilt,) = levels["rebuilt"]
    assert rebuilt["rank"] == 1 and rebuilt["from"] == [0, 2]
    w_prev, w_next = rebuilt["weights"]
    # both neighbours recorded their squared gradient norms with their snapshots: a real weighting, not
    # the uniform fallback, and not a one-sided copy
    assert rebuilt["note"] == "" and 0 < w_prev < 1 and math.isclose(w_prev + w_next, 1.0), rebuilt
    ops = levels["operators"]
    stage1 = {op for op in ops if re.fullmatch(r"(dense|gate)\.L1|expert\.L1\.E\d+", op)}
    assert len(stage1) == 2 + 4 and all(ops[op] == "checkfree" for op in stage1), ops  # 4 experts, 1 layer
    assert all(ops[op] != "checkfree" for op in set(ops) - stage1)
    assert ops["embedding"] in ("window_replay", "replay_beside_rebuilt", "local_point")
    assert levels["resume"] <= 6
    log = "".join(Path(p).read_text() for p in res["logs"])
    assert "rank 1 rebuilt by CheckFree from ranks [0, 2]" in log and "level approximate" in log
    # the later failure of rank 1 is recovered exactly from its own window, and its boost stays
    assert later_levels["level"] == "exact" and later["recovery_levels"]["level"] == "exact"
    assert later["recovery_point"]["start"] >= 6 and later["routing_checked"] > 0, later["recovery_point"]
    # rank 1 runs on node 0's spare (moe-ft launch: a fresh process there after its second failure), or on
    # node 1's replacement (torchrun's agent)
    home = "node0" if event["replaced"] == "inprocess" else "node1"
    store = StoreConfig(root=str(tmp_path / "accepted_store" / home), job_id="accepted", rank=1).build()
    after = [t for t in store.points() if t >= later["recovery_point"]["resume"]]
    assert after, store.points()
    for t in after:
        lrs = store.load_meta(t).tensors[GROUP_LR]
        assert torch.equal(lrs, torch.tensor([[3e-3 * 1.1, 3e-4 * 1.1]] * lrs.shape[0], dtype=torch.float64)), (t, lrs)
    # training went on to the end with finite losses
    final = re.findall(rf"iteration\s+{ITERS}/{ITERS} \| loss ([0-9.naninf]+)", log)
    assert final and all(math.isfinite(float(x)) for x in final), final


@pytest.mark.timeout(600)
def test_lost_stage_refused_below_min_level(corpus, tmp_path):
    res = lose_stage_1(corpus, tmp_path, "refused", "exact", max_restarts=1)
    assert res["rc"] not in (0, 124), f"the job should stop, not finish or hang (rc {res['rc']}), see {res['logs']}"
    assert res["reports"] == []  # refused before anything was restored
    log = "".join(Path(p).read_text() for p in res["logs"])
    lines = [line for line in log.splitlines() if "moe-ft recovery refused" in line]
    assert lines, log[-3000:]
    assert lines[0].startswith("error: moe-ft recovery refused: the best available recovery is approximate")
    assert "--ft-min-recovery-level is exact" in lines[0] and "RecoveryRefused" not in log
    audit = Path(tmp_path / "refused_store" / "node0" / "refused" / "recovery_audit.jsonl")
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert records and all(r["refused"] and r["planned"] == "approximate" for r in records)
    assert not os.path.exists(tmp_path / "refused" / "refused.json")  # no final digest: training never resumed


@pytest.mark.timeout(600)
def test_no_point_from_before_a_rebuild_is_replayed_as_exact(corpus, tmp_path):
    """After CheckFree rebuilt stage 1 (resuming at 6 at the latest), stage 3 is SIGKILLed at iteration 7,
    before a window started after the rebuild is complete. Its window from before the rebuild holds the
    old timeline (stage 2's logs since then carry the rebuilt stage's activations): replaying it would mix
    both and be labelled exact (what happened before). Every point, replica and log of the old timeline is
    dropped after the rebuild, and the last stage cannot be rebuilt from one neighbour, so the honest
    answer is to start over (accepted here: ``--ft-min-recovery-level none``)."""
    res = lose_stage_1(corpus, tmp_path, "timeline", "none", max_restarts=3, faults=["3:7"], scope="localized")
    assert res["rc"] == 0 and res["digest"], f"the drill failed (rc {res['rc']}), see {res['logs']}"
    first, later = res["reports"]
    assert first["recovery_levels"]["path"] == "checkfree", first["recovery_levels"]
    assert first["recovery_point"]["resume"] <= 7
    assert later["recovery_levels"]["level"] == "start_over", later["recovery_levels"]
    assert later["scope"].get("mode") != "localized", later["scope"]
