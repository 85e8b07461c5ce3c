"""A ``persist`` fault fires *during* the write of a ``--save`` checkpoint (``StepHooks.during_checkpoint_write``:
every rank's shards on disk, the checkpoint not finalized, the tracker file not yet pointing at it). Under
torchrun the restarted job must never load that torn checkpoint: ``--load`` takes the previous complete one,
and the run ends bitwise equal to a fault-free run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.checkpointing import TRACKER_FILE, torn_checkpoints
from moe_ft.cli.drill import ROOT, job_argv, read_digest
from moe_ft.drills.processes import kill_tree

ITERS, SAVE_INTERVAL = 6, 2


def run_job(*, job: str, workdir: str, faults=(), max_restarts: int = 0, timeout: float = 200, **common) -> dict:
    """The drill's tiny job (``moe_ft.cli.drill.job_argv``) on 2 ranks (DP=EP=2, distributed optimizer):
    half the start-up cost of the drill's 4-rank launches."""
    digest_out, log = os.path.join(workdir, f"{job}.json"), os.path.join(workdir, f"{job}.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "--monitor-interval=1", str(ROOT / "pretrain_gpt_moe.py"),
           *job_argv(job=job, digest_out=digest_out, faults=list(faults), **common)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun and its workers, by pid
            proc.wait()
            rc = 124
    return {"rc": rc, "digest": read_digest(digest_out), "log": log}


def test_torn_checkpoints_are_those_newer_than_the_tracker(tmp_path):
    for it in (2, 4, 6):
        (tmp_path / f"iter_{it:07d}").mkdir()
    (tmp_path / "iter_notanumber").mkdir()
    assert torn_checkpoints(str(tmp_path), 4) == ["iter_0000006"]
    assert torn_checkpoints(str(tmp_path), None) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert torn_checkpoints(str(tmp_path / "missing"), None) == []


@pytest.mark.multiproc
@pytest.mark.timeout(480)
def test_kill_during_checkpoint_write_never_loads_the_torn_checkpoint(corpus, tmp_path):
    common = dict(layout="dp2ep2", policy="none", iters=ITERS, data=corpus, store=str(tmp_path / "store"), window=3)
    ref_save = tmp_path / "ref_ckpt"
    ref = run_job(job="ref", workdir=str(tmp_path), timeout=200, **common,
                  extra=["--save", str(ref_save), "--save-interval", str(SAVE_INTERVAL)])
    assert ref["rc"] == 0 and ref["digest"], ref["log"]
    assert (ref_save / TRACKER_FILE).read_text() == str(ITERS)

    # the faulty job resumes from the fault-free run's complete checkpoint of iteration 2, trains 2 and 3,
    # and rank 1 dies while the checkpoint of iteration 4 is being written
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copytree(ref_save / "iter_0000002", save / "iter_0000002")
    (save / TRACKER_FILE).write_text("2")
    res = run_job(job="faulty", workdir=str(tmp_path), faults=["1:3:persist"], max_restarts=1, timeout=250,
                  **common, extra=["--save", str(save), "--save-interval", str(SAVE_INTERVAL), "--load", str(save)])
    log = Path(res["log"]).read_text()
    assert res["rc"] == 0, res["log"]
    assert "moe-ft fault injection: rank 1 fails at iteration 3 (persist, exit)" in log
    # the restarted job found the torn checkpoint of iteration 4, ignored it and loaded iteration 2 again
    assert "ignoring iter_0000004" in log and "the save did not finish" in log
    assert log.count(f"resumed from {save} at iteration 2") == 2, log[-4000:]
    assert f"resumed from {save} at iteration 4" not in log
    assert res["digest"] == ref["digest"]
    # the restarted job rewrote iteration 4 and finished iteration 6: both complete now
    assert (save / TRACKER_FILE).read_text() == str(ITERS)
    for it in (4, ITERS):
        assert os.path.isfile(save / f"iter_{it:07d}" / "metadata.json")
