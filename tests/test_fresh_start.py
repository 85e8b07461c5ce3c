"""A start that does not recover (restart count 0, no complete durable point) under a ``--ft-job-id`` whose
node-local store still holds points of an earlier run (a resubmitted job) stops every rank with one line and
exit 2 before it writes anything (``moe_ft/recovery/fresh_start.py``). It used to train on and fail at its first
snapshot (``ValueError: point 0 is already published``, exit 1), after publishing its survivor points into the
old run's directory. ``--ft-recover always`` resumes from those points."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moe_ft.recovery.fresh_start import held_points, stale_store_error
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig
from tests._ft_helpers import tiny_model_flags, torchrun


def _publish(root: Path, job_id: str, rank: int, iterations) -> None:
    store = StoreConfig(root=str(root), job_id=job_id, rank=rank).build()
    for it in iterations:
        with store.begin(it) as point:
            point.put(OperatorId.embedding(), Level.FULL, {"w": torch.full((4,), float(it))})
            point.publish()


def test_the_job_directory_lists_its_stores_with_points(tmp_path):
    assert held_points(str(tmp_path), "job") == {}
    _publish(tmp_path, "job", 0, [2, 3])
    _publish(tmp_path, "job/survivor", 1, [3])
    _publish(tmp_path, "other", 0, [5])  # another job on the node
    StoreConfig(root=str(tmp_path), job_id="job", rank=2).build()  # a store without points
    (tmp_path / "job" / "rank3").mkdir()  # not a store (no FORMAT.json)
    held = held_points(str(tmp_path), "job")
    assert held == {"rank0": [2, 3], os.path.join("survivor", "rank1"): [3]}
    line = stale_store_error(str(tmp_path / "job"), held, "auto")
    assert "\n" not in line and line.startswith(f"the node-local store {tmp_path / 'job'} already holds recovery "
                                                "points up to iteration 3 in 2 store directories (rank0, survivor/")
    assert line.endswith(f"(no restart and no complete durable point): pass a new --ft-job-id, --ft-recover always "
                         f"to resume from it, or delete {tmp_path / 'job'}")
    assert "(--ft-recover never)" in stale_store_error(str(tmp_path / "job"), held, "never")


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_resubmitted_job_id_stops_before_writing_and_recovers_when_told(corpus, tmp_path):
    store = tmp_path / "store"
    flags = [*tiny_model_flags("single", train_iters=4, log_interval=1), "--data-path", corpus, "--ft",
             "--ft-policy", "sparse", "--ft-sparse-window", "3", "--ft-store-dir", str(store), "--ft-job-id", "again",
             "--ft-report-dir", str(tmp_path / "reports")]
    torchrun("pretrain_gpt_moe.py", flags, nproc=2, timeout=150)
    job = store / "again"
    before = _tree(job)
    assert held_points(str(store), "again")["rank0"][-1] == 3

    proc = torchrun("pretrain_gpt_moe.py", flags, nproc=2, timeout=150, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and errors == [
        f"error: the node-local store {job} already holds recovery points up to iteration 3 in 2 store directories "
        f"(rank0, rank1) of an earlier run of this --ft-job-id, and this start does not recover from it (no restart "
        f"and no complete durable point): pass a new --ft-job-id, --ft-recover always to resume from it, or delete "
        f"{job}"], out[-4000:]
    # the workers' output ends with the line (the launcher's own traceback follows it)
    assert "exitcode  : 2" in out and "Traceback" not in out.split(errors[0])[0], out[-4000:]
    assert "iteration " not in proc.stdout and "already published" not in out, out[-4000:]
    assert _tree(job) == before  # nothing written, nothing published into the old run's directory

    resumed = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-recover", "always"], nproc=2, timeout=150)
    assert "moe-ft recovery |" in resumed.stdout + resumed.stderr
    assert sorted(os.listdir(tmp_path / "reports")) == ["recovery_000.json"]
