"""An optimizer that counts its step in the parameter group (as Transformer Engine's FusedAdam does)
recovers exactly: a rank killed mid-window, the job recovered, the final training state (parameter groups
included) bitwise equal to the fault-free run's. Before the groups were snapshotted, the recovered ranks
resumed with the step count of a fresh optimizer (or, in-process, of the failed attempt) and Adam's bias
correction differed."""

from __future__ import annotations

import os

import pytest

from moe_ft.cli.drill import ROOT, run_job
from tests._ft_helpers import check_restart_kind

pytestmark = pytest.mark.multiproc

SCRIPT = str(ROOT / "tests" / "_workers_group_step.py")


def _job(tmp_path, corpus, name: str, faults: list[str]) -> dict:
    markers = tmp_path / f"{name}_optimizers"
    markers.mkdir()
    os.environ["GROUP_STEP_MARKER_DIR"] = str(markers)
    try:
        res = run_job(job=name, workdir=str(tmp_path), faults=faults, max_restarts=1, timeout=400, script=SCRIPT,
                      layout="ep2pp2", policy="sparse", iters=8, data=corpus, store=str(tmp_path / "store"),
                      window=3, extra=[])
    finally:
        del os.environ["GROUP_STEP_MARKER_DIR"]
    assert res["rc"] == 0 and res["digest"], f"{name} failed (rc {res['rc']}), see {res['log']}"
    assert sorted(os.listdir(markers)) == [f"rank{r}" for r in range(4)], "the substitute optimizer was not built"
    return res


@pytest.mark.timeout(600)
def test_group_step_optimizer_recovers_bitwise(tmp_path, corpus):
    reference = _job(tmp_path, corpus, "group_step_faultfree", [])
    faulty = _job(tmp_path, corpus, "group_step_faulty", ["3:6:backward"])
    (report,) = faulty["reports"]
    assert report["recovery_point"]["source"] == "memory" and report["recovery_levels"]["level"] == "exact", report
    check_restart_kind(report)
    assert faulty["digest"] == reference["digest"]
