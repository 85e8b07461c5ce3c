"""``--ft-optimizer-recompute-local compute`` (MoEtion §5.2): the owner snapshots only the compute weights
of an expert it sends as gradients, plus a checksum of its FULL state; the replica peer rebuilds that FULL
entry, and a restarted owner fetches it back (or, without the peer, recovers from the newest point its own
store holds whole).

Store level (remote entries, holes, the recovery rule, retention), the stream (owner → peer, in process),
and recovery's fetch (completing the owner's points; rebuilding a lost node's). The real 4-process run
with a killed rank is in ``test_optim_recompute.py``.
"""

import json
import threading

import pytest
import torch

from moe_ft.replication import InProcessHub, ReceiverConfig
from moe_ft.replication.fetch import FetchTopology, Inventory, PeerFetch, inventory_of, plan_fetch
from moe_ft.replication.receiver import replica_store_config
from moe_ft.replication.recompute_stream import RecomputeReceiver, RecomputeSender
from moe_ft.replication.sender import SenderConfig
from moe_ft.replication.service import Replication
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import MemoryBackend, SnapshotStore, StoreConfig
from moe_ft.store.backend import MANIFEST
from moe_ft.store.codec import write_entry
from moe_ft.store.errors import CorruptEntryError, MissingEntryError
from moe_ft.store.manifest import entry_key
from moe_ft.store.retention import KeepTwoRecoverable
from moe_ft.store.rules import NewestFullRule
from tests.test_optim_recompute import D0, E, _Owner

pytestmark = pytest.mark.timeout(120)

W = {"w": torch.arange(12, dtype=torch.float32)}
FULL = {**W, "exp_avg.w": W["w"] * 0.5, "exp_avg_sq.w": W["w"] * 0.25, "step.w": torch.tensor(3.0)}


def _encoded(it: int, op: OperatorId, tensors: dict) -> bytes:
    parts: list[bytes] = []
    write_entry(lambda b: parts.append(bytes(b)), entry_key(it, op, Level.FULL), tensors, "xxh3_64")
    return b"".join(parts)


def _point(store: SnapshotStore, it: int, remote: bool, ops=(E[0],)) -> None:
    with store.begin(it) as point:
        point.put(D0, Level.FULL, {"d": torch.full((4,), float(it))})
        for op in ops:
            if remote:
                point.put(op, Level.COMPUTE, W)
                point.put_remote(op, FULL)
            else:
                point.put(op, Level.FULL, FULL)
        point.put_meta({"iteration": it})
        point.publish()


def test_remote_entry_is_hashed_not_written_and_can_be_added_once_verified():
    store = SnapshotStore(MemoryBackend(name="owner"), checksum="xxh3_64")
    plain = SnapshotStore(MemoryBackend(name="plain"), checksum="xxh3_64")
    _point(store, 3, remote=True)
    _point(plain, 3, remote=False)
    body = json.loads(store.backend.read_blob(3, MANIFEST))
    assert [e["operator"] for e in body["remote"]] == [str(E[0])]
    assert "remote" not in json.loads(plain.backend.read_blob(3, MANIFEST))  # other manifests unchanged
    full_blob = plain.catalog().point(3).entries[E[0]].blob
    assert full_blob not in store.backend.blob_names(3)  # hashed, not written
    entry = store.catalog().point(3).entries[E[0]]
    assert entry.remote and entry.level == Level.FULL
    twin = plain.catalog().point(3).entries[E[0]]
    assert (entry.checksum, entry.nbytes, entry.blob) == (twin.checksum, twin.nbytes, twin.blob)
    assert store.catalog().point(3).shadowed[E[0]].level == Level.COMPUTE
    assert store.load(3, E[0], Level.COMPUTE)["w"].equal(W["w"])  # the owner's own compute weights
    assert store.catalog().holes == {(3, E[0])} and not store.catalog().problems
    with pytest.raises(MissingEntryError, match="held by the replica peers"):
        store.load(3, E[0], Level.FULL)
    data = plain.backend.read_blob(3, full_blob)
    bad = bytearray(data)
    bad[-20] ^= 1
    with pytest.raises(CorruptEntryError):
        store.add_blob(3, entry, bytes(bad))
    assert full_blob not in store.backend.blob_names(3)  # nothing written
    with pytest.raises(ValueError, match="not a remote entry"):
        store.add_blob(3, plain.catalog().point(3).entries[D0], b"")
    store.add_blob(3, entry, data)
    catalog = store.catalog()
    assert not catalog.holes and not catalog.point(3).entries[E[0]].remote  # held here now
    got = store.load(3, E[0], Level.FULL)
    assert all(got[k].equal(v) for k, v in FULL.items())


@pytest.mark.parametrize("layout", ["arena", "files"])
def test_local_fs_add_blob_is_atomic_and_refuses_an_existing_blob(tmp_path, layout):
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, layout=layout).build()
    _point(store, 1, remote=True)
    entry = store.catalog().point(1).entries[E[0]]
    data = _encoded(1, E[0], FULL)
    store.add_blob(1, entry, data)
    assert [p.name for p in (tmp_path / "j" / "rank0" / "points").iterdir() if p.name.startswith(".")] == []
    with pytest.raises(FileExistsError):
        store.add_blob(1, entry, data)
    assert not store.verify().problems and not store.verify().holes


def test_recovery_rule_never_falls_back_past_a_hole_and_retention_keeps_the_local_fallback():
    """E0 FULL locally at 0, left to the peers at 1-3 (1 fetched back, 2 and 3 not). The snapshots of 2 and
    3 reset E0's token counters, so restoring E0 from 1 or 0 there would lose uncounted tokens: the newest
    usable end is 0, then 1 once fetched. Retention keeps the newest point restorable without any peer
    (``local_only``) beside the two newest ones."""
    store = SnapshotStore(MemoryBackend(name="owner"), checksum="xxh3_64")
    _point(store, 0, remote=False)
    for it in (1, 2, 3):
        _point(store, it, remote=True)
    rule = NewestFullRule(operators=frozenset({D0, E[0]}))
    assert store.newest_recoverable(rule, verify=True).end == 0  # 1-3 need E0 from the peers
    _point(store, 4, remote=False, ops=())  # E0 not saved at 4: its newest state is still the hole at 3
    assert store.newest_recoverable(rule, verify=True).end == 0
    local_only = NewestFullRule(operators=frozenset({D0, E[0]}), local_only=True)
    store.add_blob(1, store.catalog().point(1).entries[E[0]], _encoded(1, E[0], FULL))
    point = store.newest_recoverable(rule, verify=True)
    assert (point.end, point.full_at[E[0]]) == (1, 1)
    assert store.newest_recoverable(local_only).end == 1  # fetched: held here now
    # retention decides on what this process wrote (peers hold the remote entries): the newest two ends
    # are 4 and 3 (E0 from 3), and the local fallback 0 stays
    gc = SnapshotStore(MemoryBackend(name="gc"), checksum="xxh3_64", retention=KeepTwoRecoverable(rule=rule))
    _point(gc, 0, remote=False)
    for it in range(1, 7):
        _point(gc, it, remote=True)
    assert gc.points() == [0, 5, 6]
    # no point restorable without the peers (E0 was never written FULL here): nothing extra is kept, the
    # store stays bounded
    bounded = SnapshotStore(MemoryBackend(name="gc"), checksum="xxh3_64", retention=KeepTwoRecoverable(rule=rule))
    for it in range(7):
        _point(bounded, it, remote=True)
    assert bounded.points() == [5, 6]
    plain = SnapshotStore(MemoryBackend(name="plain"), checksum="xxh3_64", retention=KeepTwoRecoverable(rule=rule))
    for it in range(7):
        _point(plain, it, remote=False)
    assert plain.points() == [5, 6]  # no remote entries: nothing extra kept


# --------------------------------------------------------------------------------------- stream + fetch
class _ComputeOnlyOwner(_Owner):
    """``_Owner`` whose snapshot leaves the FULL state of ``remote`` experts to the peer, as the engine
    does with ``--ft-optimizer-recompute-local compute``; remembers every FULL entry's bytes."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.full_bytes: dict[tuple[int, OperatorId], bytes] = {}

    def publish(self, t: int, selected, remote=frozenset()) -> None:
        with self.store.begin(t) as point:
            point.put(D0, Level.FULL, {"w": torch.full((16,), float(t))})
            for op in selected:
                full = self.full(op)
                self.full_bytes[(t, op)] = _encoded(t, op, {k: v.clone() for k, v in full.items()})
                if op in remote:
                    point.put(op, Level.COMPUTE, dict(self.params[op]))
                    point.put_remote(op, full)
                else:
                    point.put(op, Level.FULL, full)
            point.put_meta({"iteration": t})
            point.publish()
        self.capture.track(selected)


def _run_stream(tmp_path, selection):
    owner = _ComputeOnlyOwner(StoreConfig(root=str(tmp_path / "node0"), job_id="j", rank=0,
                                          checksum="xxh3_64").build())
    replica = replica_store_config(root=str(tmp_path / "node1"), job_id="j", owner=0).build()
    hub = InProcessHub()
    receiver = RecomputeReceiver(ReceiverConfig(keep_points=16), hub.endpoint(1), [0], lambda o: replica)
    sender = RecomputeSender(SenderConfig(), owner.store, hub.endpoint(0), [1], owner=0, capture=owner.capture)
    rep = Replication(sender, receiver, None, None, compute_only=True)
    remote = {}
    for t, chosen in enumerate(selection):
        owner.step(t)
        plan = {E[e]: Level.FULL for e in chosen}
        remote[t] = rep.remote_full(t, plan)
        owner.publish(t, [E[e] for e in sorted(chosen)], remote[t])
        sender.submit(t)
        sender.flush()
    sender.close()
    receiver.join(timeout=10)
    return owner, replica, sender, receiver, remote


SELECTION = [{0, 1}, {0, 1}, {0, 1, 2}, {0, 2}, {0, 2}, {1, 2}, {1, 2}]


def test_owner_keeps_compute_weights_and_the_peer_rebuilds_the_full_state(tmp_path):
    owner, replica, sender, receiver, remote = _run_stream(tmp_path, SELECTION)
    # an expert is left to the peer from the second point of a stable period on
    assert remote == {0: set(), 1: {E[0], E[1]}, 2: {E[0], E[1]}, 3: {E[0], E[2]}, 4: {E[0], E[2]},
                      5: {E[2]}, 6: {E[1], E[2]}}
    assert not sender.lost and not receiver.failures and not receiver.rejections
    assert len(receiver.recomputed) == sum(map(len, remote.values()))
    for t, ops in remote.items():
        point = owner.store.catalog([t]).point(t)
        for op in ops:  # locally: the compute weights and the FULL checksum, no FULL file
            assert point.entries[op].remote and point.shadowed[op].level == Level.COMPUTE
            assert point.entries[op].blob not in owner.store.backend.blob_names(t)
    for (t, op), data in owner.full_bytes.items():  # the peer holds every FULL state, byte for byte
        entry = replica.catalog([t]).point(t).entries[op]
        assert entry.level == Level.FULL and replica.backend.read_blob(t, entry.blob) == data, (t, op)
    written = sum(owner.store.backend.blob_size(t, n) for t in owner.store.points()
                  for n in owner.store.backend.blob_names(t) if n.endswith(".ent"))
    full = sum(len(b) for b in owner.full_bytes.values())
    assert written < full  # (plus the dense entries and metadata, which are small here)


def _fetch(tmp_path, owner_store, replica):
    topo = FetchTopology(dp_group={0: [0], 1: [1]}, expert_dp_group={0: [0], 1: [1]},
                         distributed_optimizer=False)
    invs = [Inventory(rank=0, local=inventory_of(owner_store), replicas={}),
            Inventory(rank=1, local={}, replicas={0: inventory_of(replica, replica=True)})]
    plan = plan_fetch(invs, topo)
    hub, results, errors = InProcessHub(), {}, []

    def one(r, local):
        try:
            results[r] = PeerFetch(hub.endpoint(r), r, local, lambda o: replica).run(plan)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    empty = SnapshotStore(MemoryBackend(name="rank1"))
    threads = [threading.Thread(target=one, args=(0, owner_store)), threading.Thread(target=one, args=(1, empty))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    return plan, results[0]


def test_a_restarted_owner_fetches_the_rebuilt_entries_and_recovers_from_them(tmp_path):
    owner, replica, *_ = _run_stream(tmp_path, SELECTION)
    replica.delete_point(6)  # the peer never got the last point (the owner died before sending it)
    rule = NewestFullRule(operators=frozenset({D0, *E[:3]}))
    restarted = StoreConfig(root=str(tmp_path / "node0"), job_id="j", rank=0, checksum="xxh3_64").build()
    # its own entries alone restore nothing: E2 is FULL from 2 on, where E0 and E1 are left to the peer
    assert restarted.newest_recoverable(rule, verify=True) is None
    plan, result = _fetch(tmp_path, restarted, replica)
    assert plan.completed == {0: [1, 2, 3, 4, 5]} and not plan.points
    assert result.completed == [1, 2, 3, 4, 5] and not result.points
    assert any("iteration 6" in why for why in result.skipped), result.skipped
    catalog = restarted.verify()
    assert {t for t, _ in catalog.holes} == {6} and not catalog.problems
    point = restarted.newest_recoverable(rule, verify=True)
    assert point.end == 5  # 6 needs E1 and E2 from the peer, which does not have them
    for op, t in point.full_at.items():
        if op.is_expert:  # verified on load, and the owner's own bytes
            assert restarted.load(t, op, Level.FULL)
            entry = restarted.catalog([t]).point(t).entries[op]
            assert restarted.backend.read_blob(t, entry.blob) == owner.full_bytes[(t, op)], (t, op)


def test_a_lost_node_is_rebuilt_with_the_full_entries_its_owner_never_wrote(tmp_path):
    owner, replica, *_ = _run_stream(tmp_path, SELECTION)
    empty = StoreConfig(root=str(tmp_path / "new-node0"), job_id="j", rank=0, checksum="xxh3_64").build()
    plan, result = _fetch(tmp_path, empty, replica)
    assert result.points == list(range(7)) and not result.skipped
    catalog = empty.verify()
    assert not catalog.problems and not catalog.holes
    for (t, op), data in owner.full_bytes.items():
        entry = catalog.point(t).entries[op]
        assert empty.backend.read_blob(t, entry.blob) == data
    # published under the owner's manifest, byte for byte
    assert all(empty.backend.read_blob(t, MANIFEST) == owner.store.backend.read_blob(t, MANIFEST) for t in range(7))


def test_flag_checks():
    from moe_ft.config import FTConfig

    FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True,
                        ft_optimizer_recompute_local="compute")
    with pytest.raises(ValueError, match="add --ft-optimizer-recompute"):
        FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute_local="compute")
    with pytest.raises(ValueError, match="--ft-replication-bandwidth"):
        FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True,
                            ft_optimizer_recompute_local="compute", ft_replication_bandwidth=1e9)
    with pytest.raises(ValueError, match="durable tier"):
        FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True,
                            ft_optimizer_recompute_local="compute", ft_persist_interval=2)
    with pytest.raises(ValueError, match="'full' or 'compute'"):
        FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True,
                            ft_optimizer_recompute_local="weights")
