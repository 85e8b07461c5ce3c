"""Lost-node recovery: a replaced node's ranks rebuild their node-local stores from the
replica holders and data-parallel peers, spread over the sources, every entry verified.

Six ranks on three simulated nodes (``[0,0,1,1,2,2]``), ``r = 2`` replicas, data-parallel groups
``[0,2,4]`` and ``[1,3,5]`` (each dense operator has a data-parallel copy on every other node, so its
COMPUTE and — without the distributed optimizer — FULL entries are *not* replicated, MoEtion §5.1: they
come back from a peer's own store). Threads stand in for processes; the in-process transport for gloo.
"""

import shutil
import threading

import pytest
import torch
from _ft_helpers import damage_blob

from moe_ft.replication import InProcessHub, ReceiverConfig, ReplicaReceiver, ReplicaSender, SenderConfig
from moe_ft.replication.fetch import FetchTopology, Inventory, PeerFetch, inventory_of, needs_fetch, plan_fetch
from moe_ft.replication.placement import ReplicaPlacementConfig, has_copy_off_node, needs_replication, place_replicas
from moe_ft.replication.receiver import replica_store_config
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig

pytestmark = pytest.mark.timeout(120)

NODE_OF = [0, 0, 1, 1, 2, 2]
DP = [[0, 2, 4], [1, 3, 5]]
ITERS = range(4, 8)


def ops_of(rank):
    return [OperatorId.dense(0), OperatorId.expert_op(0, rank)]


def tensors(op, level, it, rank):
    # dense state is the same on every data-parallel replica; an expert belongs to one rank
    seed = it * 100 + (op.expert if op.is_expert else 50 + rank % 2)
    w = torch.arange(64, dtype=torch.float32) + seed
    return {"w": w} if level == Level.COMPUTE else {"w": w, "exp_avg.w": w * 0.5, "main.w": w.double()}


def level_of(op, it):
    if not op.is_expert and it == 6:
        return None  # a sparse point need not hold every operator (active ones save nothing)
    return Level.FULL if it == (4 if not op.is_expert else 5) else Level.COMPUTE


def node_dir(tmp_path, node):
    return str(tmp_path / f"node{node}")


def local_store(tmp_path, rank):
    return StoreConfig(root=node_dir(tmp_path, NODE_OF[rank]), job_id="j", rank=rank).build()


def replica_store(tmp_path, holder, owner):
    return replica_store_config(root=node_dir(tmp_path, NODE_OF[holder]), job_id="j", owner=owner).build()


@pytest.fixture
def job(tmp_path):
    """Snapshots of iterations 4..7 on every rank, replicated with MoEtion §5.1 deduplication."""
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=2), node_of=NODE_OF, dp_groups=DP)
    hub = InProcessHub()
    receivers = [ReplicaReceiver(ReceiverConfig(), hub.endpoint(r), plan.sources[r],
                                 lambda o, r=r: replica_store(tmp_path, r, o)) for r in range(6)]
    senders = []
    for r in range(6):
        store = local_store(tmp_path, r)
        for it in ITERS:
            with store.begin(it) as point:
                for op in ops_of(r):
                    if level_of(op, it) is not None:
                        point.put(op, level_of(op, it), tensors(op, level_of(op, it), it, r))
                point.put_meta({"rank": r, "iteration": it})
                point.publish()
        group = next(g for g in DP if r in g)
        dp_off = has_copy_off_node(r, group, NODE_OF)
        select = lambda e, dp_off=dp_off: needs_replication(e.op, e.level, dp_copy_off_node=dp_off,
                                                            expert_dp_copy_off_node=False,
                                                            distributed_optimizer=False)
        sender = ReplicaSender(SenderConfig(), store, hub.endpoint(r), plan.peers[r], owner=r, select=select)
        for it in ITERS:
            sender.submit(it)
        senders.append(sender)
    for s in senders:
        s.close()
    for rec in receivers:
        rec.join(30)
    topo = FetchTopology(dp_group={r: g for g in DP for r in g},
                         expert_dp_group={r: [r] for r in range(6)}, distributed_optimizer=False)
    return plan, topo


def inventories(tmp_path, plan):
    return [Inventory(rank=r, local=inventory_of(local_store(tmp_path, r)),
                      replicas={o: inventory_of(replica_store(tmp_path, r, o), replica=True) for o in plan.sources[r]})
            for r in range(6)]


def run_fetch(tmp_path, plan, fetch_plan):
    hub = InProcessHub()
    results, errors = {}, []

    def one(r):
        try:
            results[r] = PeerFetch(hub.endpoint(r), r, local_store(tmp_path, r),
                                   lambda o: replica_store(tmp_path, r, o)).run(fetch_plan)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def lose_node(tmp_path, node):
    shutil.rmtree(node_dir(tmp_path, node))


def test_replaced_node_rebuilds_its_stores_from_holders_and_dp_peers(tmp_path, job):
    plan, topo = job
    # the dense operator's entries were not replicated (a data-parallel copy lives on every other node)
    held = inventory_of(replica_store(tmp_path, plan.peers[4][0], 4))
    assert held and all(str(OperatorId.dense(0)) not in p.entries for p in held.values())
    lose_node(tmp_path, 2)  # ranks 4 and 5, their stores and the replicas node 2 held
    fetch_plan = plan_fetch(inventories(tmp_path, plan), topo)
    assert fetch_plan.points == {4: list(ITERS), 5: list(ITERS)} and not fetch_plan.skipped
    assert not [t for t in fetch_plan.transfers if t.dst not in (4, 5)]  # survivors fetch nothing
    results = run_fetch(tmp_path, plan, fetch_plan)
    for r in (4, 5):
        assert results[r].points == list(ITERS)
        assert len(results[r].sources) >= 2, results[r].sources  # spread over the holders and peers
        assert {NODE_OF[s] for s in results[r].sources} == {0, 1}
        store = local_store(tmp_path, r)
        assert store.points() == list(ITERS)
        for it in ITERS:
            assert store.catalog().point(it).entries.keys() == {op for op in ops_of(r) if level_of(op, it)}
            for op in (op for op in ops_of(r) if level_of(op, it)):
                got = store.load(it, op, level_of(op, it))  # verified against the owner's checksums
                want = tensors(op, level_of(op, it), it, r)
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            assert store.load_meta(it).meta == {"rank": r, "iteration": it}


def test_corrupt_replica_falls_back_to_the_other_holder(tmp_path, job):
    plan, topo = job
    lose_node(tmp_path, 2)
    bad_holder = plan.peers[4][0]
    store = replica_store(tmp_path, bad_holder, 4)
    blob = store.catalog().point(6).entries[OperatorId.expert_op(0, 4)].blob
    damage_blob(store, 6, blob, lambda data: data[:-20] + bytes([data[-20] ^ 0xFF]) + data[-19:])
    fetch_plan = plan_fetch(inventories(tmp_path, plan), topo)
    expert6 = [t for t in fetch_plan.transfers if t.dst == 4 and t.iteration == 6 and
               any(b.startswith("expert") for b in t.blobs)]
    assert [t.src for t in expert6] == [h for h in plan.peers[4] if h != bad_holder]
    results = run_fetch(tmp_path, plan, fetch_plan)
    assert results[4].points == list(ITERS)
    assert torch.equal(local_store(tmp_path, 4).load(6, OperatorId.expert_op(0, 4), Level.COMPUTE)["w"],
                       tensors(OperatorId.expert_op(0, 4), Level.COMPUTE, 6, 4)["w"])


def test_point_without_a_source_is_skipped_with_the_reason(tmp_path, job):
    plan, topo = job
    lose_node(tmp_path, 2)
    for holder in plan.peers[4]:  # no copy of rank 4's expert at iteration 7 anywhere
        store = replica_store(tmp_path, holder, 4)
        entry = store.catalog().point(7).entries[OperatorId.expert_op(0, 4)]
        damage_blob(store, 7, entry.blob, lambda data: None)
    fetch_plan = plan_fetch(inventories(tmp_path, plan), topo)
    assert fetch_plan.points[4] == [4, 5, 6]
    assert "iteration 7" in fetch_plan.skipped[4][0] and "expert" in fetch_plan.skipped[4][0]
    # with the distributed optimizer a peer's FULL dense entry is another shard: never a source
    topo_dist = FetchTopology(dp_group=topo.dp_group, expert_dp_group=topo.expert_dp_group,
                              distributed_optimizer=True)
    skipped = plan_fetch(inventories(tmp_path, plan), topo_dist).skipped[4]
    assert any(s.startswith("iteration 4") and "dense" in s for s in skipped)


def test_needs_fetch_only_beyond_the_newest_local_point():
    inv = Inventory(rank=0, local={5: None, 6: None}, replicas={})
    assert needs_fetch(inv, {3, 4, 5, 6, 7}) == [7]
    assert needs_fetch(Inventory(rank=0, local={}, replicas={}), {3, 4}) == [3, 4]


def test_peer_copy_that_differs_from_the_owners_is_rejected(tmp_path, job):
    """A data-parallel peer's entry is used only if it is byte-for-byte what the owner saved (checked against
    the owner's manifest): here the peers' dense COMPUTE of iteration 7 differs (valid in their own stores)."""
    plan, topo = job
    lose_node(tmp_path, 2)
    for peer in (0, 2):
        store = local_store(tmp_path, peer)
        store.delete_point(7)
        with store.begin(7) as point:
            for op in ops_of(peer):
                extra = 1.0 if not op.is_expert else 0.0
                point.put(op, level_of(op, 7), {k: v + extra for k, v in tensors(op, level_of(op, 7), 7, peer).items()})
            point.put_meta({"rank": peer, "iteration": 7})
            point.publish()
    fetch_plan = plan_fetch(inventories(tmp_path, plan), topo)
    assert 7 in fetch_plan.points[4]  # the inventory cannot know; the bytes decide
    results = run_fetch(tmp_path, plan, fetch_plan)
    assert results[4].points == [4, 5, 6]
    assert any(s.startswith("iteration 7") and "dense.L0@COMPUTE" in s for s in results[4].skipped), results[4].skipped
    assert 7 not in local_store(tmp_path, 4).points()



def test_holders_are_whoever_offers_the_copies_not_the_plan(tmp_path, job):
    """A rank that a spare on another node took over, or a placement that changed since: the replicas of a
    lost rank are served by the ranks whose node holds them, found by what they offer (every rank offers its
    node's replica stores), not by the current placement. Here each node's both ranks offer the node's copies."""
    plan, topo = job
    lose_node(tmp_path, 1)
    invs = [Inventory(rank=r, local=inventory_of(local_store(tmp_path, r)),
                      replicas={o: inventory_of(replica_store(tmp_path, r, o), replica=True)
                                for node_rank in range(6) if NODE_OF[node_rank] == NODE_OF[r]
                                for o in plan.sources[node_rank] if o != r})
            for r in range(6)]
    fetch_plan = plan_fetch(invs, topo)
    for r in (2, 3):  # node 1's ranks: everything they had comes back, from ranks on nodes 0 and 2
        srcs = {t.src for t in fetch_plan.transfers if t.dst == r}
        assert srcs and srcs <= {0, 1, 4, 5}, (r, srcs)
        assert fetch_plan.points[r] == list(ITERS), fetch_plan.points[r]
    results = run_fetch(tmp_path, plan, fetch_plan)
    for r in (2, 3):
        assert results[r].points == list(ITERS)
        assert local_store(tmp_path, r).verify().problems == ()


def test_nodes_are_where_ranks_run():
    from moe_ft.replication.placement import nodes_from_places

    assert nodes_from_places([0, 0, 1, 1], ranks_per_node=2) == [0, 0, 1, 1]
    assert nodes_from_places([0, 0, 0, 1], ranks_per_node=2) == [0, 0, 0, 1]  # rank 2 now runs on node 0
    assert nodes_from_places([5, 5, 3, 3], ranks_per_node=0) == [1, 1, 0, 0]  # any numbering of the groups
    assert nodes_from_places([0, 0, 0, 0], ranks_per_node=2) == [0, 0, 1, 1]  # one agent: simulated by blocks
    assert nodes_from_places([0, 0, 0, 0], ranks_per_node=0) == [0, 0, 0, 0]


def test_a_peer_that_cannot_read_what_it_must_send_fails_its_receivers_at_once(tmp_path, job):
    """A holder whose point went missing between the plan and the send raises; the ranks waiting for it get the
    end of its stream and fail too, at once, instead of waiting for the group's timeout (a day) while the
    holder's process lives on (in-process restarts)."""
    plan, topo = job
    lose_node(tmp_path, 2)
    fetch_plan = plan_fetch(inventories(tmp_path, plan), topo)
    src = next(t.src for t in fetch_plan.transfers if t.dst == 4)
    for store in [local_store(tmp_path, src), *(replica_store(tmp_path, src, o) for o in plan.sources[src])]:
        for it in store.points():
            store.delete_point(it)  # gone after the plan was made
    hub = InProcessHub()
    errors: dict[int, BaseException] = {}

    def one(r):
        try:
            PeerFetch(hub.endpoint(r), r, local_store(tmp_path, r), lambda o: replica_store(tmp_path, r, o)).run(fetch_plan)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[r] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a receiver still waits for the peer that failed"
    assert src in errors and 4 in errors and "got None" in str(errors[4]), errors
