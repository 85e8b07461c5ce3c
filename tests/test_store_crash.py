"""A writer process killed with SIGKILL at a deterministic point of a write leaves every earlier point
readable and the torn one invisible. The writer is a real forked process: its fault hook announces the
chosen (phase, iteration, n-th occurrence) on a pipe and blocks there; the test then kills it with
``os.kill(pid, SIGKILL)`` and reopens the store as a restarted worker would. (Fork, not spawn, so the child
does not pay for importing torch; it computes nothing with torch, it only writes tensors made before the
fork.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepAll, SnapshotStore, codec, open_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = [OperatorId.dense(0), OperatorId.gate(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]
KILL_AT = 3  # iteration being written when the writer dies


def tensors_for(iteration: int, op: OperatorId) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(iteration * 1000 + zlib.crc32(str(op).encode()) % 997)
    return {"weight": torch.randn(128, 128, generator=gen).to(torch.bfloat16),
            "master.weight": torch.randn(128, 128, generator=gen),
            "exp_avg.weight": torch.randn(128, 128, generator=gen)}


DATA = {(it, op): tensors_for(it, op) for it in range(1, KILL_AT + 1) for op in OPS}


def publish_point(store: SnapshotStore, iteration: int) -> None:
    with store.begin(iteration) as point:
        for op in OPS:
            point.put(op, Level.FULL, DATA[iteration, op])
        point.put_meta({"iteration": iteration, "loss_scale": 2.0**iteration})
        point.publish()


def _writer(directory: str, layout: str, phase: str, nth: int, conn) -> None:
    codec.CHUNK = 16 << 10  # several chunks per entry, so "mid-entry" is a real partial file
    seen = 0

    def hook(p: str, iteration: int, name: str) -> None:
        nonlocal seen
        if p == phase and iteration == KILL_AT:
            seen += 1
            if seen == nth:
                conn.send(name)
                time.sleep(120)  # killed here

    store = SnapshotStore(open_backend(directory, layout=layout, fault_hook=hook), retention=KeepAll())
    for iteration in range(1, KILL_AT + 1):
        publish_point(store, iteration)
    conn.send(None)


def kill_writer_at(directory, phase: str, nth: int, layout: str = "arena") -> str:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(str(directory), layout, phase, nth, child))
    proc.start()
    try:
        assert parent.poll(60), "writer never reached the kill point"
        where = parent.recv()
        assert where is not None, f"writer finished without reaching {phase} #{nth}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return where


def check_points(store: SnapshotStore, iterations) -> None:
    for it in iterations:
        for op in OPS:
            loaded = store.load(it, op, Level.FULL)
            assert all(torch.equal(loaded[n], t) for n, t in DATA[it, op].items())
        assert store.load_meta(it).meta == {"iteration": it, "loss_scale": 2.0**it}


@pytest.fixture(params=["arena", "files"])
def layout(request) -> str:
    return request.param


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase,nth", [("blob_write", 1), ("blob_write", 20), ("blob_closed", 2), ("before_commit", 1)])
def test_killed_writer_leaves_previous_points_and_no_torn_point(tmp_path, layout, phase, nth):
    where = kill_writer_at(tmp_path, phase, nth, layout)
    if phase == "blob_write" and nth > 1:
        assert where == f"{OPS[1]}.full.ent"  # died inside the second entry: a partial file exists
    store = SnapshotStore(open_backend(tmp_path), retention=KeepAll())
    assert store.points() == [1, 2]
    (torn,) = store.staging()
    # the arena: a dead writer's regions are free space again (nothing of them is held)
    assert torn.iteration == KILL_AT and not torn.live and (torn.nbytes > 0) == (layout == "files")
    catalog = store.verify()
    assert catalog.problems == () and catalog.iterations == [1, 2]
    assert store.newest_recoverable(DenseRule(operators=frozenset(OPS)), verify=True).end == 2
    check_points(store, [1, 2])
    # The restarted writer sweeps the leftovers and snapshots the iteration again.
    assert store.backend.sweep_staging() == 1 and store.staging() == []
    publish_point(store, KILL_AT)
    assert store.newest_recoverable(DenseRule(operators=frozenset(OPS)), verify=True).end == KILL_AT
    check_points(store, [1, 2, 3])


@pytest.mark.timeout(120)
def test_kill_after_commit_keeps_the_point(tmp_path, layout):
    kill_writer_at(tmp_path, "after_commit", 1, layout)
    store = SnapshotStore(open_backend(tmp_path))
    assert store.points() == [1, 2, 3] and store.staging() == []
    assert store.verify().problems == ()
    check_points(store, [1, 2, 3])


@pytest.mark.timeout(120)
def test_inspect_reports_torn_point_without_failing(tmp_path, layout):
    kill_writer_at(tmp_path, "blob_closed", 1, layout)
    result = subprocess.run([sys.executable, "-m", "moe_ft", "inspect", str(tmp_path), "--verify"],
                            cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 published point(s), checksums verified" in result.stdout
    assert f"unpublished iteration {KILL_AT} (torn, writer gone" in result.stdout
