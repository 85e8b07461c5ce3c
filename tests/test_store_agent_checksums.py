"""Checksums recorded after publish (``--ft-checksum-by agent``, ``moe_ft/agent/verify.py``): the writer passes
over each byte once, the node agent's side (``SnapshotStore.record_verified``) hashes the published point, and
readers verify against the recorded digests; before that a point is checked for its structure only.

Unit level on both on-disk layouts; the agent process and a training run with a real kill are in
``tests/test_node_agent.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import CorruptEntryError, DenseRule, KeepNewestRecoverable, StoreConfig
from moe_ft.store.codec import PENDING

OPS = [OperatorId.expert_op(0, e) for e in range(2)]


def _flip(store, iteration: int, blob: str, offset: int) -> None:
    """Flip one bit of a published blob in place (its bytes, wherever the layout keeps them)."""
    path, start, _ = store.backend.blob_location(iteration, blob)
    with open(path, "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)[0]
        f.seek(start + offset)
        f.write(bytes([byte ^ 0x10]))


def _publish(store, iteration: int) -> None:
    with store.begin(iteration) as point:
        for i, op in enumerate(OPS):
            point.put(op, Level.FULL, {"weight": torch.full((64,), float(iteration + i)), "step": torch.tensor([iteration])})
        point.put_meta({"iteration": iteration})
        point.publish()


@pytest.mark.parametrize("layout", ["arena", "files"])
def test_a_deferred_point_is_verified_once_the_agent_recorded_its_digests(tmp_path, layout):
    config = StoreConfig(root=str(tmp_path), job_id="j", rank=0, layout=layout, checksum_by="agent")
    store = config.build(retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
    _publish(store, 0)
    point = store.catalog().point(0)
    assert all(e.checksum == PENDING for e in point.entries.values()) and point.meta.checksum != PENDING
    blob = point.entries[OPS[0]].blob
    assert torch.equal(store.load(0, OPS[0], Level.FULL)["weight"], torch.zeros(64))  # structure only

    # the agent's side: another process's reader of the same directory hashes and records
    reader = StoreConfig(root=str(tmp_path), job_id="j", rank=0, layout=layout).build()
    digests = reader.record_verified(0)
    assert set(digests) == {e.blob for e in point.entries.values()}
    resolved = store.catalog().point(0)
    assert all(e.checksum == digests[e.blob] for e in resolved.entries.values())
    assert reader.record_verified(0) == digests  # recorded for this manifest already: not hashed again

    # from now on any flipped bit of a payload is found, as for a point hashed by its writer
    _flip(store, 0, blob, point.entries[OPS[0]].nbytes // 2)
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        store.load(0, OPS[0], Level.FULL)
    assert not store.verify([0]).point(0) or OPS[0] not in store.verify([0]).point(0).entries

    # the writer's own pass: each operator byte written once, not hashed
    with store.begin(1) as p:
        p.put(OPS[0], Level.FULL, {"weight": torch.ones(1024)})
        assert p.touched == p._entries[OPS[0]].nbytes
        p.put(OPS[1], Level.FULL, {"weight": torch.ones(8)})
        p.put_meta({"iteration": 1})
        p.publish()


def test_an_unverified_entry_is_checked_for_its_structure_and_old_digests_never_apply(tmp_path, caplog):
    config = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum_by="agent")
    store = config.build(retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
    _publish(store, 0)
    entry = store.catalog().point(0).entries[OPS[1]]
    # before the agent hashed it, a flipped payload bit is not detectable (nothing to compare with): said once
    _flip(store, 0, entry.blob, entry.nbytes // 2)
    with caplog.at_level(logging.WARNING, logger="moe_ft.store"):
        store.load(0, OPS[1], Level.FULL)
    assert "iteration 0 is not verified yet" in caplog.text
    # a torn trailer is found all the same
    _flip(store, 0, entry.blob, entry.nbytes - 2)
    with pytest.raises(CorruptEntryError, match="bad trailer"):
        store.load(0, OPS[1], Level.FULL)

    # digests recorded for a point of an abandoned timeline do not apply to the point published again
    _publish(store, 1)
    store.record_verified(1)
    recorded = (store._verified_path(1)).read_text()
    store.discard_after(0)
    assert not store._verified_path(1).exists()  # deleted with its point
    _publish(store, 1)
    store._verified_path(1).write_text(recorded)  # the old timeline's record, put back (a late agent)
    # each publish's manifest is its own (time, writer): the record names another one and does not apply
    assert all(e.checksum == PENDING for e in store.catalog().point(1).entries.values())

    # garbage collection drops the records of deleted points
    store.record_verified(1)
    _publish(store, 2)
    store.record_verified(2)
    _publish(store, 3)  # keeps the newest recoverable point only: 0, 1 and 2 go, with their records
    assert store.points() == [3] and list(store._verified_path(0).parent.iterdir()) == []
    store.record_verified(3)
    assert [p.name for p in store._verified_path(0).parent.iterdir()] == ["3.json"]


def _edit_header(store, iteration: int, blob: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (as long) in a published entry's header: still valid JSON, another table."""
    path, start, size = store.backend.blob_location(iteration, blob)
    with open(path, "r+b") as f:
        f.seek(start)
        data = bytearray(f.read(size))
        at = data.index(old)
        data[at:at + len(old)] = new
        f.seek(start)
        f.write(data)


@pytest.mark.parametrize("layout", ["arena", "files"])
def test_an_unverified_entry_whose_tensor_table_is_damaged_is_a_corrupt_entry(tmp_path, layout):
    """Before the agent hashed a point only its structure is checked: a header whose tensor table names bytes
    beyond the entry, or a shape its bytes do not hold, is a corrupt entry that verify skips and load names
    (it was a raw ``ValueError`` from the view of the buffer, through verify and the recovery search)."""
    config = StoreConfig(root=str(tmp_path), job_id="j", rank=0, layout=layout, checksum_by="agent")
    store = config.build()  # no retention: both points kept
    rule = DenseRule(operators=frozenset(OPS))
    _publish(store, 0)
    _publish(store, 1)
    point = store.catalog().point(1)
    beyond, reshaped = (point.entries[op].blob for op in OPS)
    _edit_header(store, 1, beyond, b'"nbytes":256', b'"nbytes":956')  # past the entry's end
    _edit_header(store, 1, reshaped, b'"shape":[64]', b'"shape":[65]')  # 260 bytes for 256
    catalog = store.verify()
    assert {(p.iteration, p.what) for p in catalog.problems} >= {(1, f"{op}@FULL") for op in OPS}, catalog.problems
    assert store.newest_recoverable(rule, verify=True).end == 0
    for op, blob in zip(OPS, (beyond, reshaped)):
        with pytest.raises(CorruptEntryError, match=f"iteration 1 {blob}: unreadable header"):
            store.load(1, op, Level.FULL)
        with pytest.raises(CorruptEntryError, match=f"iteration 1 {blob}: unreadable header"):
            store.load(1, op, Level.FULL, out={"weight": torch.empty(64), "step": torch.empty(1, dtype=torch.int64)})
    with pytest.raises(CorruptEntryError, match="unreadable header"):
        store.record_verified(1)  # the agent records no digest of a damaged entry


@pytest.mark.parametrize("hashed_first", [True, False])
def test_a_durable_copy_of_a_verified_point_carries_its_digests(tmp_path, hashed_first):
    """The agent hashes a point, then copies it; a copy requested before the hashing ran (the trainer's
    next snapshot can send it first) hashes the point itself: no durable manifest holds a pending digest."""
    from moe_ft.persist import DurableTier, PersistWriter

    store = StoreConfig(root=str(tmp_path / "node"), job_id="j", rank=0, checksum_by="agent").build()
    _publish(store, 0)
    if hashed_first:
        store.record_verified(0)
    tier = DurableTier(str(tmp_path / "durable"), "j", 1)
    writer = PersistWriter(store, tier, DenseRule(operators=frozenset(OPS)), rank=0, interval=1, keep=1, publish_timeout=0.0)
    assert writer.persist(0).complete
    durable = tier.store(0)
    point = durable.catalog().point(0)
    assert all(e.checksum != PENDING for e in point.entries.values())
    assert not durable.verify().problems and torch.equal(durable.load(0, OPS[1], Level.FULL)["weight"],
                                                           torch.ones(64))
    assert all(e.checksum != PENDING for e in store.catalog().point(0).entries.values())  # recorded here too


def test_the_agent_keeps_segment_mappings_and_never_hashes_a_deleted_store_through_them(tmp_path):
    """The hashing side maps each arena segment once and keeps it for the next points (a point written
    into regions it mapped before is hashed through the same mapping, and its new bytes are what it hashes);
    a store removed and created again under the same path is a new file, mapped again; the mapping of a
    store that is gone is dropped."""
    import shutil

    from moe_ft.store import store as store_module

    def build():
        config = StoreConfig(root=str(tmp_path / "node"), job_id="j", rank=0, checksum_by="agent")
        return config.build(retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))

    store = build()
    reader = StoreConfig(root=str(tmp_path / "node"), job_id="j", rank=0).build()
    for it in range(4):  # regions reused point after point (one point kept)
        _publish(store, it)
        reader.record_verified(it)
        assert torch.equal(store.load(it, OPS[1], Level.FULL)["weight"], torch.full((64,), float(it + 1)))
    path = store.backend.blob_location(3, store.catalog().point(3).entries[OPS[0]].blob)[0]
    first = store_module._SEGMENTS._maps[path]
    shutil.rmtree(tmp_path / "node")
    store = build()  # the same path, another file; a stale mapping would hash the deleted store's bytes
    reader = StoreConfig(root=str(tmp_path / "node"), job_id="j", rank=0).build()
    _publish(store, 7)
    reader.record_verified(7)
    assert store_module._SEGMENTS._maps[path][0] != first[0]
    assert torch.equal(store.load(7, OPS[0], Level.FULL)["weight"], torch.full((64,), 7.0))  # digest matches
    assert store.verify([7]).problems == ()
    shutil.rmtree(tmp_path / "node")
    store_module._SEGMENTS._prune()
    assert path not in store_module._SEGMENTS._maps
