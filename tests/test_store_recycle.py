"""Recycled entry files of the file backend (``moe_ft/store/local.py``): deleting a point moves its entry
files into a pool keyed by size; the next entry of exactly that size (any operator) is written over one in
place (tmpfs pages reused). The pool is bounded by one round of deletions. Readers must not be able to tell."""

from __future__ import annotations

import os

import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepNewestRecoverable, LocalFSBackend, SnapshotStore
from moe_ft.store.manifest import entry_blob

E0, E1 = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)


def _store(tmp_path, recycle=True) -> SnapshotStore:
    return SnapshotStore(LocalFSBackend(tmp_path / "rank0", recycle=recycle),
                         retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset([E0]))))


def _put(store: SnapshotStore, t: int, numel: int, op=E0, extra: bool = False) -> dict:
    tensors = {"w": torch.arange(numel, dtype=torch.float32) + t}
    with store.begin(t) as point:
        point.put(op, Level.FULL, tensors)
        if extra:
            point.put(E1, Level.COMPUTE, {"w": torch.ones(3)})
        point.put_meta({"t": t})
        point.publish()
    return tensors


def _inode(tmp_path, t: int, op=E0) -> int:
    return os.stat(tmp_path / "rank0" / "points" / f"{t:012d}" / entry_blob(op, Level.FULL)).st_ino


def _entry_bytes(store: SnapshotStore, t: int) -> int:
    point = store.catalog().point(t)
    return sum(e.nbytes for e in point.entries.values()) + point.meta.nbytes


def test_entries_of_a_pooled_size_are_written_over_deleted_files_and_read_back_exactly(tmp_path):
    store = _store(tmp_path)
    pool = store.backend._pool
    _put(store, 0, 5000, extra=True)
    inode, deleted = _inode(tmp_path, 0), _entry_bytes(store, 0)
    _put(store, 1, 5000)  # GC deletes 0: its three entry files (not the manifest) go to the pool
    assert len(os.listdir(tmp_path / "rank0" / "recycle")) == 3 and pool.reused == 0
    assert pool.bytes == pool.limit == deleted
    second = _put(store, 2, 5000)  # same sizes: E0's entry and the metadata entry reuse point 0's files
    assert _inode(tmp_path, 2) == inode and pool.reused == 2
    assert torch.equal(store.load(2, E0, Level.FULL)["w"], second["w"])
    assert store.load_meta(2).meta == {"t": 2}
    # another operator's entry of the same size takes a pooled file too: the pool is keyed by size
    _put(store, 3, 5000, op=E1)
    assert pool.reused == 4
    assert torch.equal(store.load(3, E1, Level.FULL)["w"], torch.arange(5000, dtype=torch.float32) + 3)
    assert not store.verify().problems


def test_an_entry_of_another_size_gets_a_new_file_and_the_pool_stays_bounded(tmp_path):
    store = _store(tmp_path)
    pool = store.backend._pool
    for t in range(6):
        _put(store, t, 1000 + 100 * t)  # every entry size new (the metadata entry's stays the same)
        if t == 4:
            point4 = _entry_bytes(store, 4)
        assert pool.bytes <= pool.limit
    assert pool.reused == 4  # only the metadata entries
    # one point deleted per round, each larger than the one before: the bound is the last round's bytes
    # and the pool holds that round's files only (older ones were freed)
    assert store.points() == [5] and pool.bytes == pool.limit == point4
    assert len(os.listdir(tmp_path / "rank0" / "recycle")) == 2 and not store.verify().problems


def test_a_short_write_after_a_size_hint_is_truncated(tmp_path):
    store = _store(tmp_path)
    _put(store, 0, 5000)
    _put(store, 1, 5000)
    size = store.catalog().point(1).entries[E0].nbytes
    writer = store.backend.begin_point(7)
    sink = writer.open_blob("x.ent")
    sink.expect(size)  # takes point 0's file of that size ...
    sink.write(b"abc")  # ... and writes less than promised
    sink.close()
    assert os.path.getsize(writer.path / "x.ent") == 3
    writer.abort()


def test_aborted_point_with_a_recycled_file_is_swept_and_leaves_published_points_intact(tmp_path):
    store = _store(tmp_path)
    _put(store, 0, 5000)
    first = _put(store, 1, 5000)
    with store.begin(2) as point:  # takes the pooled file of E0's size, then dies before publishing
        point.put(E0, Level.FULL, {"w": torch.zeros(5000)})
    assert store.points() == [1] and not store.staging()
    assert torch.equal(store.load(1, E0, Level.FULL)["w"], first["w"])
    assert not store.verify().problems


def test_recycling_off_frees_the_files_and_a_previous_pool_is_freed_on_open(tmp_path):
    store = _store(tmp_path, recycle=False)
    for t in range(3):
        _put(store, t, 100)
    assert not (tmp_path / "rank0" / "recycle").exists()
    assert store.points() == [2] and not store.verify().problems
    store = _store(tmp_path)
    _put(store, 3, 100)
    assert os.listdir(tmp_path / "rank0" / "recycle")
    reopened = _store(tmp_path)  # a restarted process: the old pool's bound is unknown, its files go
    assert os.listdir(tmp_path / "rank0" / "recycle") == [] and reopened.points() == [3]


def test_store_config_switch(tmp_path):
    from moe_ft.store import StoreConfig

    files = dict(root=str(tmp_path), layout="files")
    assert StoreConfig().recycle is False and StoreConfig(**files).build().backend.recycle is False
    assert StoreConfig(**files, job_id="r", recycle=True).build().backend.recycle is True


def test_a_pooled_file_removed_behind_the_pools_back_gives_a_new_file(tmp_path):
    store = _store(tmp_path)
    _put(store, 0, 5000)
    _put(store, 1, 5000)
    for name in os.listdir(tmp_path / "rank0" / "recycle"):  # e.g. another process opened the store
        os.unlink(tmp_path / "rank0" / "recycle" / name)
    third = _put(store, 2, 5000)
    assert store.backend._pool.reused == 0
    assert torch.equal(store.load(2, E0, Level.FULL)["w"], third["w"]) and not store.verify().problems
