"""Completeness rules and retention policies: which recovery point is newest for each snapshot policy, and
what garbage collection keeps after each publish."""

from __future__ import annotations

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import (
    DenseRule,
    KeepNewestRecoverable,
    MemoryBackend,
    NewestFullRule,
    SnapshotStore,
    SparseWindowRule,
    TripleBuffer,
)

E0, E1, E2 = (OperatorId.expert_op(0, e) for e in range(3))
D0, G0 = OperatorId.dense(0), OperatorId.gate(0)


def put_point(store: SnapshotStore, iteration: int, levels: dict[OperatorId, Level], meta: bool = True) -> None:
    with store.begin(iteration) as point:
        for op, level in levels.items():
            point.put(op, level, {"weight": torch.full((2,), float(iteration))})
        if meta:
            point.put_meta({"iteration": iteration})
        point.publish()


# MoEvement Fig. 6 with W_sparse = 2 and order [E0, E1 | D0, G0] (ascending popularity):
# slice 0 FULL at w0 (the rest COMPUTE), slice 1 FULL at w0 + 1 (slice 0 NONE).
SPARSE = [
    {E0: Level.FULL, E1: Level.FULL, D0: Level.COMPUTE, G0: Level.COMPUTE},
    {D0: Level.FULL, G0: Level.FULL},
]
SPARSE_OPS = frozenset([E0, E1, D0, G0])


def sparse_store(num_iterations: int, retention=None, skip=None, meta_missing=()) -> SnapshotStore:
    store = SnapshotStore(MemoryBackend(), retention=retention)
    for it in range(num_iterations):
        levels = {op: lvl for op, lvl in SPARSE[it % 2].items() if (it, op) != skip}
        put_point(store, it, levels, meta=it not in meta_missing)
    return store


def test_sparse_window_rule_finds_newest_complete_window():
    store = sparse_store(5)  # windows [0,1], [2,3]; 4 starts the window in flight
    rule = SparseWindowRule.aligned(SPARSE_OPS, window_size=2)
    rp = store.newest_recoverable(rule, verify=True)
    assert (rp.start, rp.end) == (2, 3)
    assert rp.full_at == {E0: 2, E1: 2, D0: 3, G0: 3}
    refs = {(r.iteration, str(r.op), r.level) for r in rp.entries}
    assert (2, "dense.L0", Level.COMPUTE) in refs and (3, "dense.L0", Level.FULL) in refs
    assert (2, "None", None) in refs and (3, "None", None) in refs  # metadata of every iteration
    assert rp.iterations == [2, 3]
    assert (store.newest_recoverable(rule, at_or_before=2).end) == 1
    assert rule(store.catalog(), 2) is None  # no window ends at 2


@pytest.mark.parametrize("damage", [dict(skip=(2, G0)), dict(skip=(3, D0)), dict(meta_missing=(3,))],
                         ids=["frozen_without_compute", "never_full", "no_meta"])
def test_sparse_window_incomplete_falls_back(damage):
    store = sparse_store(4, **damage)
    rp = store.newest_recoverable(SparseWindowRule.aligned(SPARSE_OPS, window_size=2))
    assert (rp.start, rp.end) == (0, 1)
    if "meta_missing" in damage:
        rule = SparseWindowRule.aligned(SPARSE_OPS, window_size=2, require_meta=False)
        assert store.newest_recoverable(rule).end == 3


def test_explicit_windows_after_a_resize():
    store = SnapshotStore(MemoryBackend())
    put_point(store, 0, {E0: Level.FULL, D0: Level.FULL})
    put_point(store, 1, {E0: Level.FULL, D0: Level.COMPUTE})  # window resized to 2 at iteration 1
    put_point(store, 2, {D0: Level.FULL})
    rule = SparseWindowRule.explicit([E0, D0], [(0, 0), (1, 2)])
    assert store.newest_recoverable(rule).full_at == {E0: 1, D0: 2}
    assert SparseWindowRule.aligned([E0, D0], window_size=1)(store.catalog(), 2) is None


def test_sparse_retention_keeps_one_window_and_the_one_in_flight():
    store = SnapshotStore(MemoryBackend(), retention=KeepNewestRecoverable(rule=SparseWindowRule.aligned(SPARSE_OPS, 2)))
    kept = []
    for it in range(6):
        put_point(store, it, SPARSE[it % 2])
        kept.append(store.points())
    assert kept == [[0], [0, 1], [0, 1, 2], [2, 3], [2, 3, 4], [4, 5]]


def test_pec_triple_buffer_keeps_each_operators_newest_full():
    # PEC with K = 1 expert per layer, sequential: expert (it mod 3) FULL, dense FULL every iteration.
    store = SnapshotStore(MemoryBackend(), retention=TripleBuffer(floor=NewestFullRule(operators=frozenset([E0, E1, E2, D0]))))
    plain = SnapshotStore(MemoryBackend(), retention=TripleBuffer())
    for it in range(5):
        for s in (store, plain):
            put_point(s, it, {(E0, E1, E2)[it % 3]: Level.FULL, D0: Level.FULL})
    assert plain.points() == [3, 4]  # recovery buffer + persist buffer; the third is in flight
    assert store.points() == [2, 3, 4]  # E2's newest FULL lives at 2
    assert store.newest_full(E2) == 2 and store.newest_full(E0, at_or_before=2) is None  # 0 was collected
    rp = store.newest_recoverable(NewestFullRule(operators=frozenset([E0, E1, E2, D0])), verify=True)
    assert (rp.start, rp.end, rp.full_at) == (2, 4, {E0: 3, E1: 4, E2: 2, D0: 4})
    assert torch.equal(store.load(2, E2, Level.FULL)["weight"], torch.full((2,), 2.0))


def _flip_byte(store: SnapshotStore, iteration: int, op: OperatorId) -> None:
    from moe_ft.store.manifest import entry_blob

    blobs = store.backend._points[iteration]
    name = entry_blob(op, Level.FULL)
    blobs[name] = blobs[name][:40] + bytes([blobs[name][40] ^ 1]) + blobs[name][41:]


@pytest.mark.parametrize("damage", ["flipped byte", "entry missing", "manifest missing"])
def test_newest_full_rule_does_not_restore_an_older_full_entry_than_a_damaged_one(damage):
    """A lossy rule restores each operator's newest FULL entry; where that entry is damaged, an older one of it
    is not its newest state (the counters recorded with ``end`` were reset at the damaged one, and a
    data-parallel replica with an intact entry would restore the newer one): the points that would restore the
    older one are refused, the search goes back to a point before the damage."""
    store = SnapshotStore(MemoryBackend())
    put_point(store, 1, {E0: Level.FULL, E1: Level.FULL, D0: Level.FULL})
    put_point(store, 2, {E0: Level.FULL, D0: Level.FULL})
    put_point(store, 3, {E1: Level.FULL, D0: Level.FULL})
    put_point(store, 4, {E0: Level.FULL, E1: Level.FULL, D0: Level.FULL})
    rule = NewestFullRule(operators=frozenset([E0, E1, D0]))
    assert store.newest_recoverable(rule, at_or_before=3, verify=True).full_at == {E0: 2, E1: 3, D0: 3}
    if damage == "flipped byte":
        _flip_byte(store, 2, E0)
    elif damage == "entry missing":
        from moe_ft.store.manifest import entry_blob

        del store.backend._points[2][entry_blob(E0, Level.FULL)]
    else:
        from moe_ft.store.backend import MANIFEST

        del store.backend._points[2][MANIFEST]
    rp = store.newest_recoverable(rule, at_or_before=3, verify=True)
    assert (rp.end, rp.full_at) == (1, {E0: 1, E1: 1, D0: 1})  # 3 and 2 would restore E0 from 1, older than 2
    assert store.newest_recoverable(rule, verify=True).end == 4  # E0 FULL again at 4: the damage is behind it


def test_dense_retention_and_newest_full():
    store = SnapshotStore(MemoryBackend(), retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset([E0, D0]))))
    put_point(store, 10, {E0: Level.FULL, D0: Level.FULL})
    put_point(store, 20, {E0: Level.FULL})
    assert store.points() == [10, 20]
    assert store.newest_full(D0) == 10 and store.newest_full(E0) == 20 and store.newest_full(E0, 15) == 10
    assert store.newest_full(E1) is None
    put_point(store, 30, {E0: Level.FULL, D0: Level.FULL})
    assert store.points() == [30]


def test_invalid_configurations_say_what_to_do():
    with pytest.raises(ValueError, match="num_buffers"):
        TripleBuffer(num_buffers=1)
    with pytest.raises(ValueError, match="window_size"):
        SparseWindowRule.aligned(SPARSE_OPS, window_size=0)


def test_a_sparse_rule_answers_again_from_its_memo_only_for_the_same_records():
    """``SparseWindowRule`` keeps its recent answers (garbage collection asks about the same windows after every
    publish): the same point records give the same answer without a new check; another record for an iteration
    of the window (a point written again, or read back from the manifests) is checked again; the memo is not
    pickled."""
    import pickle

    from moe_ft.store import rules as rules_module
    from moe_ft.store.catalog import Catalog

    store = SnapshotStore(MemoryBackend())
    for i in range(4):
        put_point(store, i, SPARSE[i % 2])
    rule = SparseWindowRule.aligned(SPARSE_OPS, 2)
    calls = []
    real = rules_module.sparse_window_complete
    rules_module.sparse_window_complete = lambda *a, **k: calls.append(a[1:3]) or real(*a, **k)
    try:
        catalog = store.catalog()
        first = rule(catalog, 3)
        assert first is not None and (first.start, first.end) == (2, 3) and calls == [(2, 3)]
        again = Catalog({it: catalog.point(it) for it in catalog.iterations})  # the same records, a new view
        assert rule(again, 3) is first and calls == [(2, 3)]
        reread = store.catalog()  # records decoded again from the manifests: other objects
        assert rule(reread, 3) == first and calls == [(2, 3), (2, 3)]
        broken = Catalog({it: reread.point(it) for it in reread.iterations if it != 2})
        assert rule(broken, 3) is None and calls[-1] == (2, 3)
        for end in (1, 3, 5, 7, 9, 11, 13, 15, 17, 19):  # more windows than the memo keeps
            rule(reread, end)
        assert len(rule._memo) <= SparseWindowRule.MEMO_SIZE
    finally:
        rules_module.sparse_window_complete = real
    explicit = SparseWindowRule.explicit(SPARSE_OPS, [(2, 3)])
    explicit(store.catalog(), 3)
    copy = pickle.loads(pickle.dumps(explicit))
    assert explicit._memo and copy._memo == {} and copy(store.catalog(), 3) == first
