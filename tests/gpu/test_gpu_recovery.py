"""End to end on one GPU: a tiny MoE GPT trains with ``--ft --ft-policy sparse`` under
``torchrun --max-restarts``, the deterministic fault plan kills it inside a sparse window and again with a
snapshot copy in flight, torchrun restarts it, it recovers from the node-local store (sparse-to-dense
replay, MoEvement §3.3) and ends with a training-state digest bitwise equal to the fault-free run's.
Deterministic mode (the default, ``--no-deterministic`` turns it off: ``torch.use_deterministic_algorithms``) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``; NCCL backend (world size 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ft.cli.drill import TINY, read_digest, read_reports
from moe_ft.drills.processes import kill_tree
from tests.gpu._results import record

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
ITERS, WINDOW = 9, 3
PRELOAD = os.environ.get("MOE_FT_TEST_PRELOAD") == "1"
"""``MOE_FT_TEST_PRELOAD=1``: the ``moe-ft launch`` runs start every worker (fresh processes and spares) as a
fork of one server that imported the training stack (``--preload``): whether that server stays clear of CUDA
on a GPU node (the launcher refuses with one line if not) and what the imports cost the recovery. The
results are recorded under ``gpu_recovery_<launcher>_preload``."""


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    # no spare: the dead rank's device goes to a fresh process (imports paid again, unless preloaded)
    "inprocess": [sys.executable, "-m", "moe_ft.launch", "--spares-per-node", "0", *(["--preload"] if PRELOAD else [])],
    # a warm spare shares the one GPU while it waits (it holds no context and joins no communicator until it
    # takes the dead rank, whose process is gone by then)
    "inprocess_spare": [sys.executable, "-m", "moe_ft.launch", "--spares-per-node", "1",
                        *(["--preload"] if PRELOAD else [])],
}


def launch(tmp: Path, data: str, job: str, faults: list[str], max_restarts: int, launcher: str = "torchrun") -> dict:
    digest = tmp / f"{job}.json"
    argv = [*TINY, "--moe-token-dispatcher-type", "alltoall", "--train-iters", str(ITERS), "--data-path", data,
            "--ft", "--ft-policy", "sparse", "--ft-store-dir", str(tmp / "store"), "--ft-job-id", job,
            "--ft-sparse-window", str(WINDOW), "--ft-digest-out", str(digest)]
    if faults:
        argv += ["--ft-fail", *faults]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [*LAUNCHERS[launcher], "--standalone", "--nproc-per-node=1",
           f"--max-restarts={max_restarts}", "--monitor-interval=1", str(ROOT / "pretrain_gpt_moe.py"), *argv]
    log = tmp / f"{job}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=280)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            rc = 124
    return {"rc": rc, "digest": read_digest(str(digest)), "reports": read_reports(str(tmp / "store"), job),
            "log": log.read_text()}


def test_sparse_recovery_on_one_gpu_is_bitwise_exact(tmp_path, corpus):
    ref = launch(tmp_path, corpus, "faultfree", [], 0)
    assert ref["rc"] == 0 and ref["digest"], ref["log"][-6000:]
    faults = ["0:4:forward", "0:7:snapshot"]  # inside window [3, 5]; copy of 7 in flight inside [6, 8]
    res = launch(tmp_path, corpus, "faulty", faults, 2)
    assert res["rc"] == 0, res["log"][-6000:]
    reports = res["reports"]
    record("gpu_recovery", {"digest_equal": res["digest"] == ref["digest"],
                            "reports": [{k: r[k] for k in ("restart_count", "recovery_point", "replayed_iterations",
                                                           "reexecuted_iterations", "seconds")} for r in reports]})
    assert res["digest"] == ref["digest"]
    assert [r["recovery_point"]["end"] for r in reports] == [2, 5], reports
    for r in reports:
        rp = r["recovery_point"]
        assert rp["source"] == "memory" and r["token_loss"]["tokens"] == 0.0
        assert r["replayed_iterations"] == list(range(rp["start"] + 1, rp["end"] + 1))
        assert r["routing_checked"] == len(r["replayed_iterations"])


@pytest.mark.parametrize("launcher", ["inprocess", "inprocess_spare"])
def test_one_gpu_recovery_under_moe_ft_launch(tmp_path, corpus, launcher):
    """The same faults under ``moe-ft launch``: the agent gives the dead rank's device to a fresh process
    (``--spares-per-node 0``) or to a spare that waited with its imports done (``1``); the recovery's
    phases (detect, reform, restore, replay, kill-to-resume) are recorded. With ``MOE_FT_TEST_PRELOAD=1``
    every worker is forked from the preloaded server (:data:`PRELOAD`)."""
    ref = launch(tmp_path, corpus, "faultfree", [], 0)
    res = launch(tmp_path, corpus, "faulty_inprocess", ["0:4:forward", "0:7:snapshot"], 2, launcher=launcher)
    assert res["rc"] == 0, res["log"][-6000:]
    reports = res["reports"]
    record(f"gpu_recovery_{launcher}{'_preload' if PRELOAD else ''}",
           {"digest_equal": res["digest"] == ref["digest"], "preload": PRELOAD,
            "reports": [{k: r.get(k) for k in ("restart_kind", "recovery_point", "seconds")} for r in reports]})
    assert res["digest"] == ref["digest"]
    assert [r["restart_kind"] for r in reports] == ["inprocess", "inprocess"], reports
    # who took the rank: with a spare, the spare on the dead rank's device (its own index is no device here)
    taker = "a spare" if launcher == "inprocess_spare" else "a fresh process"
    assert res["log"].count(f"gives it to {taker}") == 2, res["log"][-6000:]
