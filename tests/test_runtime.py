"""FT runtime end to end through ``pretrain_gpt_moe``'s seams (4 real gloo processes, EP=2 x PP=2).

* ``sparse``: after training every operator of every rank has a FULL entry in the last window, each
  entry read back (checksum-verified) equals the live tensors captured on the training thread at that
  iteration, the metadata entry holds the replay state, and sparse copies fewer bytes per iteration than
  dense(1) would (all operators FULL).
* SIGKILL of all training processes mid-run leaves every rank's store readable by ``moe-ft inspect``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moe_ft.drills.processes import kill_tree
from tests._ft_helpers import ROOT, tiny_model_flags, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

FLAGS = [*tiny_model_flags("ep2pp2", log_interval=4), "--ft", "--ft-policy", "sparse", "--ft-sparse-window", "3"]


def test_sparse_store_holds_full_window_matching_live_tensors(tmp_path, corpus):
    store = tmp_path / "store"
    torchrun("tests/_workers_runtime.py", ["--out", str(tmp_path), "--data-path", corpus, "--train-iters", "8",
                                          "--ft-store-dir", str(store), *FLAGS])
    for rank in range(4):
        res = json.load(open(tmp_path / f"result_rank{rank}.json"))
        assert res["full_in_window"] and all(res["full_in_window"].values()), (rank, res["full_in_window"])
        assert res["compared"] > 0 and res["mismatches"] == [], (rank, res["mismatches"])
        assert res["iterations"][-1] == 7
        mean = sum(res["bytes_per_iter"]) / len(res["bytes_per_iter"])
        assert 0 < mean < res["dense1_bytes"], (rank, mean, res["dense1_bytes"])
        for key in ("grad_norm", "clip_factor", "loss_scale", "found_inf", "scheduler", "policy", "popularity",
                    "consumed_samples", "iteration", "rng.python"):
            assert key in res["meta_keys"], key


def test_the_auto_window_is_sized_for_the_replicas(tmp_path, corpus):
    """``--ft-sparse-window 0`` with replicas and ``--ft-replication-bandwidth``: FindWindowSize runs against
    that bandwidth over the replicas where it is below ``--ft-snapshot-bandwidth`` (each snapshot leaves the
    rank once per replica within the iteration), the budget the planner assumes (docs/simulator.md)."""
    store = tmp_path / "store"
    torchrun("tests/_workers_runtime.py", ["--out", str(tmp_path), "--data-path", corpus, "--train-iters", "4",
                                          "--ft-store-dir", str(store), *tiny_model_flags("single", log_interval=4),
                                          "--ft", "--ft-policy", "sparse", "--ft-sparse-window", "0",
                                          "--ft-snapshot-bandwidth", "1e15", "--ft-replicas", "1",
                                          "--ft-ranks-per-node", "1", "--ft-replication-bandwidth", "3e12"], nproc=2)
    for rank in range(2):
        res = json.load(open(tmp_path / f"result_rank{rank}.json"))
        assert res["window_bandwidth"] == 3e12, (rank, res["window_bandwidth"])
        assert res["window"] == [3, 3]  # every operator fits at that bandwidth: W = 1


def test_sigkill_leaves_store_readable(tmp_path, corpus):
    store = tmp_path / "store"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "moe_ft.drills.prelaunch", "--standalone", "--nproc-per-node=4",
           os.path.join(ROOT, "tests/_workers_runtime.py"), "--out", str(tmp_path), "--sleep-after", "4",
           "--data-path", corpus, "--train-iters", "8", "--ft-store-dir", str(store), *FLAGS]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 200
        while not all((tmp_path / f"ready_rank{r}").exists() for r in range(4)):
            assert proc.poll() is None, "training exited before the kill point"
            assert time.time() < deadline, "training did not reach the kill point"
            time.sleep(0.5)
    finally:
        for r in range(4):  # the 4 training processes themselves (each in its own session under torchrun)
            ready = tmp_path / f"ready_rank{r}"
            if ready.exists() and ready.read_text():
                with contextlib.suppress(ProcessLookupError):  # already gone
                    os.kill(int(ready.read_text()), signal.SIGKILL)
        kill_tree(proc.pid)  # torchrun and the rest (its resource tracker is spared: it removes its semaphores)
        proc.wait(timeout=30)
    for r in range(4):
        pid = int((tmp_path / f"ready_rank{r}").read_text())
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{pid}") and time.time() < deadline:  # reaped by init once dead
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], pid
    for rank in range(4):
        rank_dir = store / "default" / f"rank{rank}"
        res = subprocess.run([sys.executable, "-m", "moe_ft", "inspect", str(rank_dir), "--verify", "--json"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        listed = json.loads(res.stdout)
        assert listed, rank
