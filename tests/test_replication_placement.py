"""Replica placement (MoEtion Alg. 2 with failure domains): properties over random layouts."""

import random
from collections import Counter

import pytest

from moe_ft.replication import (
    ReplicaPlacementConfig,
    has_copy_off_node,
    needs_replication,
    nodes_from_local_world_size,
    place_replicas,
)
from moe_ft.state.operators import Level, OperatorId

pytestmark = pytest.mark.timeout(60)


def _random_layout(rng: random.Random):
    num_nodes = rng.randint(2, 8)
    per_node = rng.choice([1, 2, 4, 8])
    world = num_nodes * per_node
    dp = rng.choice([d for d in (1, 2, 4, 8) if world % d == 0])
    # Megatron orders data parallelism outermost among TP/PP here: DP group k = {k, k+S, k+2S, ...}
    stride = world // dp
    groups = [[k + stride * m for m in range(dp)] for k in range(stride)]
    nodes = nodes_from_local_world_size(world_size=world, local_world_size=per_node)
    if rng.random() < 0.3:  # an explicit, shuffled rank -> node map
        rng.shuffle(nodes)
    return nodes, groups


@pytest.mark.parametrize("seed", range(200))
def test_properties_on_random_layouts(seed):
    rng = random.Random(seed)
    nodes, groups = _random_layout(rng)
    num_nodes = len(set(nodes))
    r = rng.randint(1, 3)
    if r > num_nodes - 1:
        with pytest.raises(ValueError, match="needs at least"):
            place_replicas(ReplicaPlacementConfig(num_replicas=r), node_of=nodes, dp_groups=groups)
        return
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=r), node_of=nodes, dp_groups=groups)
    group_of = {rank: set(g) for g in groups for rank in g}
    for rank, peers in plan.peers.items():
        assert len(peers) == r
        assert nodes[rank] not in {nodes[p] for p in peers}, "replica on the owner's node"
        assert len({nodes[p] for p in peers}) == r, "two replicas on one node"
        # DP-group peers first: an eligible DP peer (other node, not on a chosen node) is never skipped
        # for an outside peer that comes before it, unless that DP peer was already full
        dp_chosen = [p for p in peers if p in group_of[rank]]
        assert peers[:len(dp_chosen)] == tuple(dp_chosen)
    loads = Counter(p for peers in plan.peers.values() for p in peers)
    assert sum(loads.values()) == r * len(nodes)
    for j, n in loads.items():
        assert plan.load(j) == n
    # <= r per receiver on regular layouts (same number of ranks on every node)
    per_node = Counter(nodes)
    if len(set(per_node.values())) == 1:
        assert max(loads.values()) <= r, loads


@pytest.mark.parametrize("seed", range(200))
def test_a_lost_nodes_ranks_on_spares_of_other_nodes_are_placed(seed):
    """After a node loss the spares of the other nodes run its ranks: nodes then hold unequal numbers of ranks,
    and a rank's data-parallel peer may be full when the outside pass found room on one node only. Every rank
    still gets ``r`` replicas on ``r`` other nodes while ``r`` is below the surviving nodes. (Found by the
    node drill ``--layout dp2ep2 --nodes 4 --fail-node 2:4``: rank 2, moved onto node 1, placed 1 of 2.)"""
    rng = random.Random(seed)
    nodes, groups = _random_layout(rng)
    lost = rng.choice(sorted(set(nodes)))
    others = sorted(set(nodes) - {lost})
    if others:  # one node: nothing survives to take its ranks, the layout stays (and r replicas cannot fit)
        nodes = [rng.choice(others) if n == lost else n for n in nodes]
    r = rng.randint(1, 3)
    survivors = len(set(nodes))
    if r > survivors - 1:  # fewer other nodes than replicas: refused with the reason, never a partial plan
        with pytest.raises(ValueError, match=f"--ft-replicas {r} needs at least {r + 1} nodes"):
            place_replicas(ReplicaPlacementConfig(num_replicas=r), node_of=nodes, dp_groups=groups)
        return
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=r), node_of=nodes, dp_groups=groups)
    assert set(plan.peers) == set(range(len(nodes)))  # every rank has its plan
    for rank, peers in plan.peers.items():
        assert len(peers) == r and nodes[rank] not in {nodes[p] for p in peers}
        assert len({nodes[p] for p in peers}) == r


def test_a_full_dp_peer_is_overloaded_when_no_other_node_has_room():
    # four nodes of one rank, node 2 lost, its rank 2 on a spare of node 1: rank 2's only other nodes are 0 and
    # 3, and its DP peer 3 is full by then
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=2), node_of=[0, 1, 1, 3], dp_groups=[[0, 1], [2, 3]])
    assert set(plan.peers[2]) == {0, 3} and set(plan.peers[1]) == {0, 3}


def test_dp_peers_preferred_when_on_other_nodes():
    # 2 nodes x 2 ranks, DP groups {0,2} and {1,3} span the nodes
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=1), node_of=[0, 0, 1, 1], dp_groups=[[0, 2], [1, 3]])
    assert plan.peers == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
    assert plan.sources == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}


def test_never_same_node_even_for_dp_peer():
    # DP group {0,1} lives on node 0: the peer shares the failure domain and must not be used
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=1), node_of=[0, 0, 1, 1], dp_groups=[[0, 1], [2, 3]])
    assert set(plan.peers) == {0, 1, 2, 3}
    for rank, peers in plan.peers.items():
        assert len(peers) == 1 and [0, 0, 1, 1][peers[0]] != [0, 0, 1, 1][rank]


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--ft-replicas 2 needs at least 3 nodes.*has 2 node"):
        place_replicas(ReplicaPlacementConfig(num_replicas=2), node_of=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        nodes_from_local_world_size(world_size=6, local_world_size=4)
    with pytest.raises(ValueError, match="in two groups"):
        place_replicas(ReplicaPlacementConfig(num_replicas=1), node_of=[0, 1], dp_groups=[[0, 1], [1]])


def test_zero_replicas():
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=0), node_of=[0])
    assert plan.peers == {0: ()} and plan.sources == {0: ()}


def test_needs_replication_skips_state_data_parallelism_keeps():
    dense, expert = OperatorId.dense(0), OperatorId.expert_op(0, 1)
    kw = dict(dp_copy_off_node=True, expert_dp_copy_off_node=False)
    assert not needs_replication(dense, Level.COMPUTE, distributed_optimizer=False, **kw)
    assert not needs_replication(dense, Level.FULL, distributed_optimizer=False, **kw)
    assert needs_replication(dense, Level.FULL, distributed_optimizer=True, **kw)  # sharded optimizer state
    assert needs_replication(expert, Level.COMPUTE, distributed_optimizer=False, **kw)  # EP shard: one copy
    none_off = dict(dp_copy_off_node=False, expert_dp_copy_off_node=False)
    assert needs_replication(dense, Level.COMPUTE, distributed_optimizer=False, **none_off)
    assert has_copy_off_node(0, [0, 2], [0, 0, 1, 1]) and not has_copy_off_node(0, [0, 1], [0, 0, 1, 1])
