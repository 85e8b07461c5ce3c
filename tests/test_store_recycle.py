"""Recycled entry files of the file backend (``moe_ft/store/local.py``): garbage collection moves a deleted
point's entry files into ``recycle/``; the next entry of the same name overwrites one in place (tmpfs pages
reused) and is truncated to its own length. Readers must not be able to tell."""

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


def _put(store: SnapshotStore, t: int, numel: int, extra: bool = False) -> dict:
    tensors = {"w": torch.arange(numel, dtype=torch.float32) + t}
    with store.begin(t) as point:
        point.put(E0, Level.FULL, tensors)
        if extra:
            point.put(E1, Level.COMPUTE, {"w": torch.ones(3)})
        point.put_meta({"t": t})
        point.publish()
    return tensors


def test_recycled_files_are_reused_truncated_and_read_back_exactly(tmp_path):
    store = _store(tmp_path)
    recycle = tmp_path / "rank0" / "recycle"
    _put(store, 0, 5000, extra=True)
    _put(store, 1, 5000)  # GC deletes 0: its entry files go to the pool, not its manifest
    assert sorted(os.listdir(recycle)) == sorted([entry_blob(E0, Level.FULL), entry_blob(E1, Level.COMPUTE),
                                                  "_meta.ent"])
    inode = os.stat(recycle / entry_blob(E0, Level.FULL)).st_ino
    small = _put(store, 2, 100)  # written over the recycled 20 kB file, truncated to ~0.5 kB
    path = tmp_path / "rank0" / "points" / f"{2:012d}" / entry_blob(E0, Level.FULL)
    assert os.stat(path).st_ino == inode
    assert os.stat(path).st_size == store.catalog().point(2).entries[E0].nbytes < 1000
    assert torch.equal(store.load(2, E0, Level.FULL)["w"], small["w"])
    assert not store.verify().problems
    # the pool keeps one file per name: deleting point 1 replaced the older file of that name
    assert len(os.listdir(recycle)) == 3
    # the unused pool entry (E1's) is not taken by another name
    assert (recycle / entry_blob(E1, Level.COMPUTE)).exists()


def test_aborted_point_with_a_recycled_file_is_swept_and_leaves_published_points_intact(tmp_path):
    store = _store(tmp_path)
    _put(store, 0, 5000)
    first = _put(store, 1, 5000)
    with store.begin(2) as point:  # takes the recycled file of E0, then dies before publishing
        point.put(E0, Level.FULL, {"w": torch.zeros(10)})
    assert store.points() == [1] and not store.staging()
    assert torch.equal(store.load(1, E0, Level.FULL)["w"], first["w"])
    assert not store.verify().problems


def test_recycling_off_frees_the_files(tmp_path):
    store = _store(tmp_path, recycle=False)
    for t in range(3):
        _put(store, t, 100)
    assert not (tmp_path / "rank0" / "recycle").exists()
    assert store.points() == [2] and not store.verify().problems


def test_store_config_switch(tmp_path):
    from moe_ft.store import StoreConfig

    assert StoreConfig().recycle is False and StoreConfig(root=str(tmp_path)).build().backend.recycle is False
    assert StoreConfig(root=str(tmp_path), job_id="r", recycle=True).build().backend.recycle is True
