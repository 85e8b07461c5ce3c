"""The arena layout's own promises (``moe_ft/store/arena.py``), beyond the backend contract that
``test_store_contract.py`` and ``test_store_crash.py`` run against it: regions are reused point after point
(the arena stops growing), one process allocates, deletions by another process are reclaimed, and a
directory removed and created again under a running process is a new arena."""

from __future__ import annotations

import multiprocessing
import os
import shutil

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import ArenaBackend, DenseRule, KeepNewestRecoverable, SnapshotStore, StoreError, open_backend
from moe_ft.store.layouts import layout_of

pytestmark = pytest.mark.timeout(60)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]


def _tensors(iteration: int, op: OperatorId, rows: int = 96) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(iteration * 31 + hash(str(op)) % 1000)
    return {"weight": torch.randn(rows, 64, generator=gen), "exp_avg.weight": torch.randn(rows, 64, generator=gen)}


def _publish(store: SnapshotStore, iteration: int, rows: int = 96) -> None:
    with store.begin(iteration) as point:
        for op in OPS:
            point.put(op, Level.FULL, _tensors(iteration, op, rows))
        point.put_meta({"iteration": iteration})
        point.publish()


def _check(store: SnapshotStore, iteration: int, rows: int = 96) -> None:
    for op in OPS:
        got = store.load(iteration, op, Level.FULL)
        assert all(torch.equal(got[k], v) for k, v in _tensors(iteration, op, rows).items())


def _keep_newest(store_dir) -> SnapshotStore:
    return SnapshotStore(ArenaBackend(store_dir), retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))


def test_regions_are_reused_and_the_arena_stops_growing(tmp_path):
    store = _keep_newest(tmp_path / "s")
    sizes = []
    for it in range(30):
        _publish(store, it)
        sizes.append(store.backend.arena_bytes)
        assert store.points() == [it]
    assert len(set(sizes)) == 1  # the first segment holds one point and the one in flight: never grown
    _check(store, 29)
    # entries of another size: reused where they fit, one more segment at most
    for it in range(30, 40):
        _publish(store, it, rows=200)
    assert store.backend.arena_bytes <= 2 * sizes[0] + (8 << 20)
    _check(store, 39, rows=200)
    assert store.verify().problems == ()


def test_open_backend_reads_either_layout_whatever_is_asked(tmp_path):
    files = open_backend(tmp_path / "f", layout="files")
    arena = open_backend(tmp_path / "a")
    assert layout_of(tmp_path / "f") == "files" and layout_of(tmp_path / "a") == "arena" and layout_of(tmp_path) is None
    assert isinstance(open_backend(tmp_path / "f"), type(files)) and isinstance(open_backend(tmp_path / "a", layout="files"), ArenaBackend)
    assert isinstance(arena, ArenaBackend)
    with pytest.raises(StoreError, match="not an arena store"):
        ArenaBackend(tmp_path / "f")
    with pytest.raises(StoreError, match="not a moe-ft store"):
        open_backend(tmp_path / "none", create=False)


def _try_write(store_dir: str, conn) -> None:
    try:
        store = SnapshotStore(ArenaBackend(store_dir))
        _publish(store, 7)
        conn.send("wrote")
    except StoreError as exc:
        conn.send(str(exc))


def test_one_process_allocates_and_others_read(tmp_path, monkeypatch):
    monkeypatch.setattr("moe_ft.store.arena.LOCK_WAIT_S", 0.2)
    store = SnapshotStore(ArenaBackend(tmp_path / "s"))
    _publish(store, 1)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_try_write, args=(str(tmp_path / "s"), child))
    proc.start()
    proc.join(30)
    said = parent.recv()
    assert f"written by another process (pid {os.getpid()})" in said and "one process writes a store" in said
    reader = SnapshotStore(open_backend(tmp_path / "s", create=False))  # reading needs no lock
    _check(reader, 1)
    assert store.points() == [1] and store.staging() == []


def test_a_released_writer_lets_another_process_write_and_writes_again_after_it(tmp_path, monkeypatch):
    """``ArenaBackend.release_writer`` (a replica store whose owner a new placement gave to a rank in another
    process): refused while a point is being written; once released, another process writes the store, and
    this process can write it again after that one is gone."""
    monkeypatch.setattr("moe_ft.store.arena.LOCK_WAIT_S", 0.2)
    backend = ArenaBackend(tmp_path / "s")
    store = SnapshotStore(backend)
    _publish(store, 1)
    writer = backend.begin_point(2)
    writer.open_blob("x").close()  # a region taken, the point not published
    assert backend.release_writer() is False
    writer.abort()
    assert backend.release_writer() is True
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_try_write, args=(str(tmp_path / "s"), child))
    proc.start()
    proc.join(30)
    assert parent.recv() == "wrote"
    _publish(store, 9)
    assert store.points() == [1, 7, 9]
    for it in (1, 7, 9):
        _check(store, it)


def _delete(store_dir: str, iteration: int) -> None:
    ArenaBackend(store_dir, create=False).delete_point(iteration)


def test_points_deleted_by_another_process_are_reclaimed(tmp_path):
    store = SnapshotStore(ArenaBackend(tmp_path / "s"))
    _publish(store, 1)
    _publish(store, 2)
    size = store.backend.arena_bytes
    ctx = multiprocessing.get_context("fork")
    for it in (1, 2):
        proc = ctx.Process(target=_delete, args=(str(tmp_path / "s"), it))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
    assert store.points() == []
    for it in range(3, 12):  # fits in the space points 1 and 2 held: no new segment
        _publish(store, it)
    assert store.backend.arena_bytes <= max(size, 4 << 20) + 2 * (4 << 20)
    assert store.verify().problems == ()
    _check(store, 11)


def test_a_directory_created_again_is_a_new_arena(tmp_path):
    store = SnapshotStore(ArenaBackend(tmp_path / "s"))
    _publish(store, 1)
    shutil.rmtree(tmp_path / "s")
    again = SnapshotStore(ArenaBackend(tmp_path / "s"))
    _publish(again, 2)
    assert again.points() == [2] and again.verify().problems == ()
    _check(again, 2)
    _publish(store, 3)  # an object of the old directory writes into the new one (a store is its path)
    assert again.points() == [2, 3] and again.verify().problems == ()
    _check(again, 3)


def test_a_blob_shorter_than_announced_keeps_its_region(tmp_path):
    """The size hint reserves the region; a blob that ends short is recorded with its length, and its
    whole region stays the point's (never handed out again while the point lives)."""
    backend = ArenaBackend(tmp_path / "s")
    point = backend.begin_point(1)
    sink = point.open_blob("short")
    sink.expect(100_000)
    sink.write(b"x" * 100)
    sink.close()
    point.commit(b"{}")
    for it in range(2, 40):  # many points of announced-size blobs around it, deleted again
        point = backend.begin_point(it)
        sink = point.open_blob("full")
        sink.expect(100_000)
        sink.write(bytes([it]) * 100_000)
        sink.close()
        point.commit(b"{}")
        if it > 3:
            backend.delete_point(it - 2)
    assert backend.read_blob(1, "short") == b"x" * 100 and backend.blob_size(1, "short") == 100
    assert backend.read_blob(39, "full") == bytes([39]) * 100_000


@pytest.mark.parametrize("mappable", [True, False], ids=["mapped", "pwrite"])
def test_the_payload_goes_through_the_mapping_or_pwrite_with_the_same_bytes(tmp_path, monkeypatch, mappable):
    """A writer copies the payload into the segment's shared mapping, or, where the file system cannot map it
    (``ENODEV``), writes it with ``pwrite``; either way another reader (a new backend, as another process
    opens it) reads the same bytes and every checksum holds."""
    import mmap as mmap_module

    from moe_ft.store import arena

    if not mappable:
        def no_mmap(*args, **kwargs):
            raise OSError(19, "No such device")

        monkeypatch.setattr(arena.mmap, "mmap", no_mmap)
    calls = []
    memmove = arena.ctypes.memmove
    monkeypatch.setattr(arena.ctypes, "memmove", lambda *a: calls.append(a[2]) or memmove(*a))
    store = _keep_newest(tmp_path / "s")
    rows = 2048  # 512 KiB tensors: each entry is written in several pieces (small ones are gathered)
    for it in range(4):
        _publish(store, it, rows)
    payload = 4 * len(OPS) * 2 * rows * 64 * 4  # 4 points of 3 entries of two tensors
    assert (sum(calls) >= payload) == mappable and bool(calls) == mappable
    monkeypatch.setattr(arena.mmap, "mmap", mmap_module.mmap)
    reader = SnapshotStore(ArenaBackend(tmp_path / "s"))
    _check(reader, 3, rows)
    assert reader.verify().problems == ()


def test_a_long_lived_reader_forgets_the_indexes_of_deleted_points(tmp_path):
    """A reader that reads each point once while the writer's garbage collection deletes them (the node agent's
    reader of a rank's store, for the whole run) keeps a bounded number of cached indexes, and a listing of the
    points drops those of the points gone; it kept one per point ever read (~27 KB a point for 64 experts)."""
    writer = _keep_newest(tmp_path / "s")
    reader = SnapshotStore(open_backend(tmp_path / "s", create=False), shared_pins=True)
    cache = reader.backend._index_cache
    most = 0
    for it in range(300):
        _publish(writer, it, rows=1)
        _check(reader, it, rows=1)
        most = max(most, len(cache))
    assert most <= 128, most  # the cache is swept when it doubled past 64 entries (arena._INDEX_CACHE_SWEEP)
    assert reader.backend.list_points() == [299] and set(cache) <= {299}


def test_a_point_published_again_and_deleted_again_while_pinned_frees_both_deferrals(tmp_path):
    """A reader of another process pins point 5 while it is deleted (its regions are kept, deferred), the same
    iteration is published again (after a rollback) and deleted again while still pinned: both deferrals'
    regions are freed once the pin goes (the second deferral replaced the first, whose regions leaked)."""
    store = SnapshotStore(ArenaBackend(tmp_path / "s"))
    pins: set[int] = set()
    store.backend.pinned_elsewhere = lambda: set(pins)  # type: ignore[method-assign]
    _publish(store, 5)
    alloc = store.backend._writer_allocator()
    first = {(seg, off) for seg, off, _ in alloc.points[5]}
    pins.add(5)
    store.delete_point(5)
    _publish(store, 5)
    second = {(seg, off) for seg, off, _ in alloc.points[5]}
    assert not first & second  # the first one's regions were still deferred
    store.delete_point(5)
    assert {(seg, off) for seg, off, _ in alloc.deferred[5]} == first | second
    pins.clear()
    _publish(store, 6)
    store.delete_point(6)  # a deletion frees what no pin holds any more
    assert alloc.deferred == {}
    free = alloc._free
    assert all(any(s == seg and o <= off < o + n for s, o, n in free) for seg, off in first | second)
