"""Failure modes of the arena store found by review, each reproduced: a full store while several threads
write a point, a reader that outlives its store directory, a segment left empty by a writer killed while
growing the arena, a full file system at the index write, the pins of dead readers, and a pin taken
while garbage collection deletes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moe_ft.snapshot.engine import _Entry, _put_all
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import KeepAll, SnapshotStore, StoreConfig, StoreError, arena, open_backend

A, B = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)


def _entry(op: OperatorId, tensor: torch.Tensor) -> _Entry:
    return _Entry(op=op, level=Level.FULL, srcs=[tensor], bufs=[], out={"w": tensor}, nbytes=tensor.nbytes,
                  dev_srcs=[], dev_bufs=[], host_srcs=[], host_bufs=[])


def _publish(store, iteration: int, op: OperatorId, tensor: torch.Tensor) -> None:
    with store.begin(iteration) as point:
        point.put(op, Level.FULL, {"w": tensor})
        point.put_meta({"it": iteration})
        point.publish()


def test_a_full_store_under_two_write_threads_aborts_the_point_after_its_last_write(tmp_path, monkeypatch):
    """The largest entry's region cannot be grown (ENOSPC) while a second thread already writes the other
    entry: the point is aborted only once that write ended, so the next point, which is given the same
    regions, is published whole; no region stays reserved for the aborted point."""
    b_writing = threading.Event()
    writes = {"n": 0}

    def hook(phase, iteration, name):
        if iteration == 1 and phase == "blob_write" and name.startswith("expert.L0.E1"):
            writes["n"] += 1
            b_writing.set()
            if writes["n"] == 2:  # in the middle of B's entry: the failure of A is raised meanwhile
                time.sleep(0.3)

    grow = arena._Allocator._grow
    full = {"on": True}

    def failing_grow(self, need):
        if not full["on"]:
            return grow(self, need)
        self.lock.release()  # let B's thread allocate and start writing first
        try:
            assert b_writing.wait(5)
        finally:
            self.lock.acquire()
        raise OSError(errno.ENOSPC, "No space left on device (test)")

    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, initial_bytes=4 << 20).build(fault_hook=hook)
    store.backend._writer_allocator()
    monkeypatch.setattr(arena._Allocator, "_grow", failing_grow)
    items = [_entry(A, torch.ones(8 << 20, dtype=torch.uint8)), _entry(B, torch.full((2 << 20,), 7, dtype=torch.uint8))]
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(OSError) as info:
            with store.begin(1) as point:
                _put_all(pool, point, items, frozenset())
        assert info.value.errno == errno.ENOSPC
        assert writes["n"] > 2, "the point was aborted while B's thread still wrote"
        full["on"] = False
        alloc = store.backend._alloc
        assert alloc.pending == {} and alloc.open_tokens == set()
        _publish(store, 2, B, torch.full((2 << 20,), 9, dtype=torch.uint8))
    assert store.verify([2]).problems == ()
    assert torch.equal(store.load(2, B, Level.FULL)["w"], torch.full((2 << 20,), 9, dtype=torch.uint8))
    assert store.points() == [2]


def test_a_writer_that_was_aborted_cannot_take_regions(tmp_path):
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build()
    writer = store.backend.begin_point(1)
    writer.abort()
    with pytest.raises(StoreError, match="already published or aborted"):
        writer.allocate(1024)
    assert store.backend._alloc.pending == {}


def test_a_reader_follows_its_store_directory_when_it_is_created_again(tmp_path):
    """A long-lived reader (the node agent keeps one per rank) reads the new store's bytes after the directory
    was removed and created again with a point of the same iteration, not the deleted segment's."""
    cfg = StoreConfig(root=str(tmp_path), job_id="j", rank=2)
    _publish(cfg.build(), 5, A, torch.full((1000,), 1.0))
    reader = SnapshotStore(open_backend(cfg.directory, create=False), shared_pins=True)
    assert reader.load(5, A, Level.FULL)["w"][0].item() == 1.0
    import shutil

    shutil.rmtree(cfg.directory)
    _publish(cfg.build(), 5, A, torch.full((1000,), 2.0))
    assert reader.load(5, A, Level.FULL)["w"][0].item() == 2.0
    assert reader.load_meta(5).meta == {"it": 5}
    assert reader.verify().problems == ()
    reader.backend.close()


def test_a_segment_left_empty_by_a_killed_grow_is_removed_at_the_next_start(tmp_path):
    """A writer killed between creating a segment and allocating it leaves an empty file that no index names:
    the next writer removes it, so that mapping every segment (the GPU engine's page-locking) works."""
    cfg = StoreConfig(root=str(tmp_path), job_id="j", rank=0)
    _publish(cfg.build(), 1, A, torch.ones(1000))
    empty = cfg.directory / "arena" / "0001"
    empty.touch()
    arena._ALLOCATORS.pop(os.path.realpath(cfg.directory)).close()  # as a new process would start
    store = cfg.build()
    maps = store.backend.mapped_segments()
    assert not empty.exists() and sorted(maps) == [0]
    assert store.verify().problems == ()
    _publish(store, 2, A, torch.full((1 << 22,), 3.0))  # the arena grows again (a new segment)
    assert store.verify().problems == ()


def test_a_failed_index_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    points = tmp_path / "points"
    points.mkdir()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device (test)")

    monkeypatch.setattr(arena.os, "fsync", full)
    with pytest.raises(OSError):
        arena._write_index(points, 3, {"m": (0, 0, 8)}, replace=False, fsync=True)
    assert os.listdir(points) == []


def test_the_pins_of_a_dead_reader_are_removed(tmp_path):
    cfg = StoreConfig(root=str(tmp_path), job_id="j", rank=0)
    store = cfg.build()
    _publish(store, 1, A, torch.ones(10))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pins = store.backend.pins_dir
    pins.mkdir(parents=True, exist_ok=True)
    (pins / f"{1:012d}.{int(dead.stdout)}.0").touch()
    with store.backend.pin_elsewhere([1]):
        assert store.backend.pinned_elsewhere() == {1}
        assert len(os.listdir(pins)) == 1  # the live pin stays, the dead one is gone
    assert store.backend.pinned_elsewhere() == set()


def test_a_pin_taken_while_garbage_collection_deletes_waits_and_finds_the_point_gone(tmp_path, monkeypatch):
    """Garbage collection reads the pins and deletes under one lock: a thread that pins a doomed point in the
    meantime enters only after the deletion, and sees the point gone rather than regions given to another."""
    store = SnapshotStore(open_backend(tmp_path / "s", create=True), retention=KeepAll())
    for it in (1, 2):
        _publish(store, it, A, torch.full((100,), float(it)))
    store.retention = type("KeepNewest", (), {"keep": staticmethod(lambda catalog: {max(catalog.iterations)})})()
    entered: list[tuple[float, bool]] = []
    deleting = threading.Event()
    delete = store.backend.delete_point

    def reader():
        with store.pin([1]):
            entered.append((time.monotonic(), 1 in store.points()))

    def slow_delete(iteration):
        deleting.set()
        time.sleep(0.2)
        delete(iteration)
        entered.append((time.monotonic(), None))

    monkeypatch.setattr(store.backend, "delete_point", slow_delete)
    thread = threading.Thread(target=lambda: (deleting.wait(5), reader()))
    thread.start()
    assert store.gc() == [1]
    thread.join(5)
    (deleted_at, _), (pinned_at, seen) = sorted(entered, key=lambda e: e[1] is not None)
    assert pinned_at >= deleted_at and seen is False


def test_a_job_skipped_after_a_failure_gives_its_regions_back_after_its_device_copy(tmp_path):
    """After the engine's thread failed, the jobs still queued are skipped; a skipped GPU job's device copy
    may still be writing into its regions, which are aborted (and its slot freed) only once it ended."""
    import queue
    from types import SimpleNamespace

    from moe_ft.snapshot.engine import SnapshotEngine

    order: list[str] = []
    job = SimpleNamespace(copied=threading.Event(), slot=3,
                          cuda_event=SimpleNamespace(synchronize=lambda: order.append("copy ended")),
                          mapped=SimpleNamespace(point=SimpleNamespace(abort=lambda: order.append("regions freed"))))
    engine = SimpleNamespace(_free=queue.Queue())
    SnapshotEngine._job_done(engine, job, RuntimeError("the thread failed"))  # type: ignore[arg-type]
    assert order == ["copy ended", "regions freed"] and job.copied.is_set() and engine._free.get_nowait() == 3


def test_a_point_another_process_pinned_after_gc_chose_it_keeps_its_regions_until_the_pin_goes(tmp_path):
    """Garbage collection chose point 1 from the pins it read; a reader of another process (the node agent)
    pinned it just after and may hold its index's places: once the index is gone the deletion reads the pins
    again and keeps the regions from the next points until a later deletion finds the pin gone."""
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build()
    store.retention = None
    for it in (1, 2):
        _publish(store, it, A, torch.full((1 << 18,), float(it)))
    backend = store.backend
    places = set(backend._index(1).values())
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        backend.pins_dir.mkdir(parents=True, exist_ok=True)
        pin = backend.pins_dir / f"{1:012d}.{reader.pid}.0"
        pin.touch()  # after the gc read the pins
        backend.delete_point(1)
        assert 1 not in store.points() and 1 in backend._alloc.deferred
        _publish(store, 3, A, torch.full((1 << 18,), 3.0))  # same size: would take point 1's regions
        assert not places & set(backend._index(3).values())
        pin.unlink()  # the reader is done
        backend.delete_point(2)
        assert backend._alloc.deferred == {}
        _publish(store, 4, A, torch.full((1 << 18,), 4.0))
        _publish(store, 5, A, torch.full((1 << 18,), 5.0))
        reused = set(backend._index(4).values()) | set(backend._index(5).values())
        assert {(seg, off) for seg, off, _ in places} & {(seg, off) for seg, off, _ in reused}
    finally:
        reader.kill()
        reader.wait()
    assert store.verify().problems == ()
