"""Losing the FIRST or LAST pipeline stage with every copy of its state, under CheckFree+.

PP=4 on 4 simulated nodes of one rank each (``moe_ft/drills/cluster.py``), ``--ft-checkfree-plus``, no replicas
and no durable tier. Node 0 (stage 0: embedding + layer 0) or node 3 (stage 3: layer 3 + final norm + output
layer) is killed at the start of iteration 6 and its store deleted:

* accepted (``--ft-min-recovery-level approximate``): the lost stage's layers are copied from its swap
  partner (stage 1, resp. 2), its embedding / output layer restored from the partner's copy of the agreed
  iteration; every rank replays the survivors' window and training runs to the end with finite losses; the
  report and the audit log label the stage ``checkfree`` (approximate);
* refused (``--ft-min-recovery-level exact``): the same loss stops the job with one line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from moe_ft.cli.drill import run_node_job
from moe_ft.drills.cluster import NodeLoss

pytestmark = pytest.mark.multiproc

ITERS, WINDOW = 10, 3
PP4 = ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "1", "--num-layers", "4",
       "--ft-replicas", "0", "--ft-ranks-per-node", "1", "--ft-checkfree-plus"]


def lose_node(corpus: str, work: Path, job: str, node: int, min_level: str, max_restarts: int) -> dict:
    workdir = work / job
    workdir.mkdir(parents=True)
    return run_node_job(job=job, workdir=str(workdir), faults=[], losses=[NodeLoss.parse(f"{node}:6")], num_nodes=4,
                        max_restarts=max_restarts, timeout=500, layout="ep2pp2", policy="sparse", iters=ITERS,
                        data=corpus, store=str(work / f"{job}_store"), window=WINDOW,
                        extra=[*PP4, "--ft-min-recovery-level", min_level])


def check_rebuilt(res: dict, work: Path, job: str, *, lost: int, partner: int, kind: str) -> None:
    assert res["rc"] == 0 and res["digest"], f"the drill failed (rc {res['rc']}), see {res['logs']}"
    (event,) = res["node_losses"]
    assert event["nodes"] == [lost]
    (report,) = res["reports"]
    levels = report["recovery_levels"]
    assert levels["path"] == "checkfree" and levels["level"] == "approximate", levels
    (rebuilt,) = levels["rebuilt"]
    assert rebuilt["rank"] == lost and rebuilt["from"] == [partner] and rebuilt["weights"] == [1.0, 0.0], rebuilt
    start = report["recovery_point"]["start"]
    assert rebuilt["note"] == (f"copy of swap partner stage {partner} (CheckFree+); {kind} restored from the copy "
                               f"of iteration {start}"), rebuilt
    ops = levels["operators"]
    lost_ops = {op for op in ops if re.fullmatch(rf"(dense|gate)\.L{lost}|expert\.L{lost}\.E\d+|{kind}", op)}
    assert len(lost_ops) == 2 + 4 + 1 and all(ops[op] == "checkfree" for op in lost_ops), ops
    assert all(ops[op] != "checkfree" for op in set(ops) - lost_ops)
    assert report["recovery_point"]["source"] == "memory" and report["routing_checked"] == 0
    assert f"rank {lost} rebuilt by CheckFree from ranks [{partner}]" in report["message"]
    # the audit log is in rank 0's job directory (node 0's replacement when node 0 was lost)
    records = [json.loads(line) for p in (work / f"{job}_store").glob(f"node*/{job}/recovery_audit.jsonl")
               for line in p.read_text().splitlines()]
    assert [r["level"] for r in records] == ["approximate"] and records[0]["operators"] == ops, records
    log = "".join(Path(p).read_text() for p in res["logs"])
    final = re.findall(rf"iteration\s+{ITERS}/{ITERS} \| loss ([0-9.naninf]+)", log)
    assert final and all(math.isfinite(float(x)) for x in final), final


@pytest.mark.timeout(600)
def test_lost_first_stage_rebuilt_from_swap_partner_and_embedding_copy(corpus, tmp_path):
    res = lose_node(corpus, tmp_path, "first", 0, "approximate", max_restarts=2)
    check_rebuilt(res, tmp_path, "first", lost=0, partner=1, kind="embedding")


@pytest.mark.timeout(600)
def test_lost_last_stage_rebuilt_from_swap_partner_and_output_copy(corpus, tmp_path):
    res = lose_node(corpus, tmp_path, "last", 3, "approximate", max_restarts=2)
    check_rebuilt(res, tmp_path, "last", lost=3, partner=2, kind="output")


@pytest.mark.timeout(600)
def test_lost_first_stage_refused_below_min_level(corpus, tmp_path):
    res = lose_node(corpus, tmp_path, "refused", 0, "exact", max_restarts=1)
    assert res["rc"] not in (0, 124), f"the job should stop, not finish or hang (rc {res['rc']}), see {res['logs']}"
    assert res["reports"] == []
    log = "".join(Path(p).read_text() for p in res["logs"])
    lines = [line for line in log.splitlines() if "moe-ft recovery refused" in line]
    assert lines and lines[0].startswith("error: moe-ft recovery refused: the best available recovery is approximate")
    assert "--ft-min-recovery-level is exact" in lines[0] and "RecoveryRefused" not in log
