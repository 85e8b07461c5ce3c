"""The node-local store's capacity (``moe_ft/store/capacity.py``, ``moe_ft/snapshot/engine.py``): a store
too small for the plan stops the job at start with one line (exit 2); a store another process fills during
the run pauses the snapshots, training goes on, and they resume when space returns. Real tmpfs mounts (the
test needs the right to mount one, as root in the CI container; skipped otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_ft.store.capacity import RankNeed, rank_need, shortfall
from tests._ft_helpers import ROOT, tiny_model_flags

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, log_interval=1, seed=1234)


@pytest.fixture
def small_tmpfs(tmp_path):
    mounted = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_the_least_a_plan_keeps(small_tmpfs):
    assert rank_need(100, localized=False, replicas=0) == 300
    assert rank_need(100, localized=True, replicas=2) == 1000
    assert rank_need(100, localized=True, replicas=0, log_bytes=10, window=3) == 400 + 40  # a window + 1 logged
    # a sparse window's snapshots (each operator FULL once, COMPUTE entries before): three windows' worth
    assert rank_need(100, localized=True, replicas=1, kept_bytes=480) == 480 * 2 + 100
    fs = small_tmpfs("1m")
    dev = os.stat(fs).st_dev
    assert shortfall([RankNeed(dev, str(fs), 256 << 10)], str(fs / "store"), str(fs / "store" / "job")) is None
    msg = shortfall([RankNeed(dev, str(fs), 1 << 20), RankNeed(dev, str(fs), 1 << 20)], str(fs / "store"),
                    str(fs / "store" / "job"))
    assert msg.startswith("the snapshot store needs at least 2.0 MiB on ") and "2 rank(s)" in msg
    assert "--shm-size" in msg and "--ft-store-dir" in msg
    assert shortfall([RankNeed(dev + 1, "/elsewhere", 1 << 30)], str(fs / "store"), str(fs / "job")) is None


def _train(store: Path, iters: int, log: Path, corpus: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [*MODEL, "--data-path", corpus, "--train-iters", str(iters), "--ft", "--ft-policy", "sparse", "--ft-sparse-window", "3",
            "--ft-replicas", "0", "--ft-store-dir", str(store), "--ft-job-id", "cap", *extra]
    cmd = [sys.executable, "-m", "moe_ft.drills.prelaunch", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "pretrain_gpt_moe.py"), *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_store_too_small_stops_at_start_with_one_line(small_tmpfs, corpus, tmp_path):
    fs = small_tmpfs("1500k")
    log = tmp_path / "small.log"
    proc = _train(fs / "store", 4, log, corpus)
    rc = proc.wait(timeout=240)
    out = log.read_text()
    errors = [line for line in out.splitlines() if line.startswith("error: the snapshot store needs at least")]
    assert rc != 0 and errors, out[-3000:]
    assert "on " + str(fs) in errors[0] and "Traceback" not in out.split(errors[0])[0][-2000:]
    assert "ENOSPC" not in out and "No space left" not in out


@pytest.mark.parametrize("publish_by", ["trainer", "agent"])
def test_a_store_filled_during_the_run_pauses_snapshots_and_training_completes(small_tmpfs, corpus, tmp_path,
                                                                               publish_by):
    """Also with the node agent publishing (``--ft-publish-by agent``): its index file, and its own files on the
    same tmpfs, find no room either; the trainer pauses its snapshots the same way."""
    fs = small_tmpfs("24m")
    log = tmp_path / "fill.log"
    proc = _train(fs / "store", 40, log, corpus, "--ft-publish-by", publish_by)
    filler = fs / "filler"
    try:
        deadline = time.monotonic() + 200
        while "iteration      4/40" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
        # another process takes every free byte; ENOSPC may come from the write or from the close's flush
        with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
            f.write(bytes(free))
        while "snapshots paused (store full)" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.2)  # a few paused iterations (~60 ms each here)
        filler.unlink()
        rc = proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert "moe-ft snapshots paused (store full)" in out and "moe-ft snapshots resumed at iteration" in out, out[-3000:]
    assert "iteration     40/40" in out and "Traceback" not in out


def test_an_arena_that_cannot_grow_fails_whole_and_keeps_its_points(small_tmpfs):
    """Growth takes its pages at once (``posix_fallocate``): a full tmpfs is an ``ENOSPC`` there, never a
    ``SIGBUS`` at a later page fault; the point in flight is aborted and the published ones stay readable."""
    import torch

    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import ArenaBackend, SnapshotStore
    from moe_ft.store.errors import store_full

    fs = small_tmpfs("9m")
    store = SnapshotStore(ArenaBackend(fs / "store"))
    op = OperatorId.expert_op(0, 0)
    big = {"w": torch.arange(3 << 18, dtype=torch.float32)}  # 3 MiB: the first 4 MiB segment holds one
    with store.begin(1) as point:
        point.put(op, Level.FULL, big)
        point.publish()
    with pytest.raises(OSError) as err, store.begin(2) as point:
        point.put(op, Level.FULL, big)  # a second 4 MiB segment; the next entry needs a third: no room
        point.put(OperatorId.expert_op(0, 1), Level.FULL, big)
        point.publish()
    assert store_full(err.value), err.value
    assert store.points() == [1] and store.staging() == [] and store.verify().problems == ()
    assert sorted(os.listdir(fs / "store" / "arena")) == ["0000", "0001", "LOCK"]  # the failed one removed
    assert torch.equal(store.load(1, op, Level.FULL)["w"], big["w"])
    store.delete_point(1)  # space returns: the next point reuses the regions
    with store.begin(3) as point:
        point.put(op, Level.FULL, big)
        point.publish()
    assert torch.equal(store.load(3, op, Level.FULL)["w"], big["w"])


def test_an_arena_without_room_for_its_usual_growth_grows_by_what_the_entry_needs(small_tmpfs):
    """A new segment is normally at least 4 MiB (``MIN_SEGMENT``) or a quarter of the arena; on a file system
    that has room for the entry but not for that, the segment is the entry's size (a 24 MiB tmpfs that held a
    2-rank sparse run paused its snapshots 6 times in 40 iterations for this, and not once since)."""
    import torch

    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import ArenaBackend, SnapshotStore

    fs = small_tmpfs("7m")
    store = SnapshotStore(ArenaBackend(fs / "store"))
    a, b = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)
    first = {"w": torch.arange(3 << 18, dtype=torch.float32)}  # 3 MiB: the first 4 MiB segment holds it
    second = {"w": torch.arange(5 << 17, dtype=torch.float32)}  # 2.5 MiB: a 4 MiB segment would not fit in 7
    with store.begin(1) as point:
        point.put(a, Level.FULL, first)
        point.put(b, Level.FULL, second)
        point.publish()
    sizes = {name: os.path.getsize(fs / "store" / "arena" / name) for name in ("0000", "0001")}
    assert sizes["0000"] == 4 << 20 and (5 << 19) < sizes["0001"] < 3 << 20, sizes
    assert store.verify().problems == ()
    assert torch.equal(store.load(1, b, Level.FULL)["w"], second["w"])


def test_a_copy_into_the_arena_that_finds_no_room_reserves_nothing(small_tmpfs):
    """The GPU path reserves a snapshot's regions on the training thread (``MappedCopier.issue``; run here on
    CPU tensors): a full tmpfs is an ``ENOSPC`` from ``issue``, the point is aborted with every region it
    had, nothing is staged, and the next snapshot that fits goes through."""
    from types import SimpleNamespace

    import torch

    from moe_ft.snapshot.mapped import MappedCopier
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import ArenaBackend, SnapshotStore
    from moe_ft.store.errors import store_full

    fs = small_tmpfs("9m")
    store = SnapshotStore(ArenaBackend(fs / "store"), checksum="mfh64")
    copier = MappedCopier(store, None)
    ops = [OperatorId.expert_op(0, e) for e in range(3)]
    big = {op: {"w": torch.full((3 << 18,), float(e))} for e, op in enumerate(ops)}  # 3 MiB each
    entries = [SimpleNamespace(op=op, level=Level.FULL, out=big[op], srcs=list(big[op].values())) for op in ops]

    def snapshot(it, items):
        job = copier.issue(it, 0, items, frozenset())
        with job.point as point:
            copier.seal(job)
            point.put_meta({})
            point.publish()

    snapshot(1, entries[:1])
    with pytest.raises(OSError) as err:
        copier.issue(2, 0, entries, frozenset())  # 9 MiB more on a 9 MiB tmpfs
    assert store_full(err.value), err.value
    assert store.points() == [1] and store.staging() == [] and store.verify().problems == ()
    store.delete_point(1)
    snapshot(3, entries[1:3])  # the regions came back
    assert store.verify().problems == ()
    assert torch.equal(store.load(3, ops[2], Level.FULL)["w"], big[ops[2]]["w"])
