"""Where each rank's snapshots are replicated (MoEtion §5.1, Alg. 2), and which of them need to be.

Pure functions of the job layout, computed once at start on every rank (same input, same answer, so no
collective is needed)::

    nodes = nodes_from_local_world_size(world_size=8, local_world_size=4)     # rank -> node
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=2), node_of=nodes, dp_groups=dp_groups)
    plan.peers[rank]        # ranks (on other nodes) that store this rank's replicas
    plan.sources[rank]      # ranks whose replicas this rank stores

Alg. 2 with failure domains: a rank's replicas go to ``r`` ranks on ``r`` distinct nodes, none on its own
node (a node failure takes the rank and its node-local store together). Peers of the same data-parallel
group come first (they already exchange gradients over the fast links, MoEtion §5.1), then the least
loaded other ranks; no receiver takes more than ``r`` replicas while another eligible rank has room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from moe_ft.state.operators import Level, OperatorId


@dataclass(kw_only=True)
class ReplicaPlacementConfig:
    num_replicas: int = 2
    """``r``: peers holding a copy of each rank's snapshots (``--ft-replicas``); 0 = no replication."""

    def __post_init__(self) -> None:
        if self.num_replicas < 0:
            raise ValueError(f"--ft-replicas must be >= 0, got {self.num_replicas}")


@dataclass(frozen=True)
class ReplicaPlan:
    """``peers[i]``: receivers of rank ``i``'s snapshots, in priority order; ``sources[j]``: senders whose
    replicas rank ``j`` stores (ascending)."""

    peers: Mapping[int, tuple[int, ...]]
    sources: Mapping[int, tuple[int, ...]]

    def load(self, rank: int) -> int:
        return len(self.sources[rank])


def nodes_from_local_world_size(*, world_size: int, local_world_size: int) -> list[int]:
    """``rank -> node`` for torchrun's contiguous layout (``LOCAL_WORLD_SIZE`` ranks per node)."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"world size {world_size} is not a multiple of LOCAL_WORLD_SIZE {local_world_size}; "
                         "pass an explicit rank->node map instead")
    return [rank // local_world_size for rank in range(world_size)]


def nodes_from_places(groups: Sequence[int], *, ranks_per_node: int) -> list[int]:
    """``rank -> node`` from the launcher group (``GROUP_RANK``: the torch elastic agent, one per node) each
    rank runs in, so that a rank a spare on another node took over counts on the node it runs on now. A job
    of one agent (``len(set(groups)) == 1``) simulates nodes by rank blocks of ``ranks_per_node`` (``0``: one
    node), as ``--ft-ranks-per-node`` asks."""
    if len(set(groups)) > 1:
        ids = {g: i for i, g in enumerate(sorted(set(groups)))}
        return [ids[g] for g in groups]
    per_node = ranks_per_node or len(groups)
    return [rank // per_node for rank in range(len(groups))]


def _group_of(dp_groups: Sequence[Sequence[int]], world_size: int) -> list[tuple[int, ...]]:
    group_of: list[tuple[int, ...] | None] = [None] * world_size
    for group in dp_groups:
        for rank in group:
            if not 0 <= rank < world_size or group_of[rank] is not None:
                raise ValueError(f"data-parallel groups must partition ranks 0..{world_size - 1}; "
                                 f"rank {rank} is out of range or in two groups")
            group_of[rank] = tuple(group)
    missing = [r for r, g in enumerate(group_of) if g is None]
    if missing:
        raise ValueError(f"ranks {missing} are in no data-parallel group")
    return group_of  # type: ignore[return-value]


def place_replicas(config: ReplicaPlacementConfig, *, node_of: Sequence[int],
                   dp_groups: Sequence[Sequence[int]] | None = None) -> ReplicaPlan:
    """MoEtion Alg. 2 with failure domains (module docstring). ``node_of[rank]``: node id of each rank;
    ``dp_groups``: the data-parallel groups (a partition of the ranks; default: one rank each).

    Raises ``ValueError`` when a rank has fewer than ``r`` other nodes to replicate to."""
    world = len(node_of)
    r = config.num_replicas
    group_of = _group_of(dp_groups if dp_groups is not None else [[i] for i in range(world)], world)
    num_nodes = len(set(node_of))
    if r > num_nodes - 1:
        raise ValueError(f"--ft-replicas {r} needs at least {r + 1} nodes (each replica on a node other than the "
                         f"owner's and than each other's), but the job has {num_nodes} node(s); lower --ft-replicas "
                         f"or give the real rank->node layout (LOCAL_WORLD_SIZE)")
    load = [0] * world
    peers: dict[int, tuple[int, ...]] = {}
    for i in range(world):
        chosen: list[int] = []
        used_nodes = {node_of[i]}

        def pick(candidates: list[int], room_only: bool = False) -> None:
            # least loaded first, then ring distance from i (spreads consecutive ranks over receivers)
            while len(chosen) < r:
                ok = [p for p in candidates if node_of[p] not in used_nodes and p not in chosen]
                if not ok:
                    return
                best = min(ok, key=lambda p: (load[p] >= r, load[p], (p - i) % world))
                if load[best] >= r and room_only:
                    return  # a full DP peer: let the outside pass find a receiver with room first
                chosen.append(best)
                used_nodes.add(node_of[best])
                load[best] += 1

        group_candidates = [p for p in group_of[i] if p != i]
        pick(group_candidates, room_only=True)
        pick([p for p in range(world) if p != i and p not in group_of[i]])
        pick(group_candidates)  # only if the outside had no room left: overload a DP peer
        if len(chosen) < r:
            raise AssertionError(f"rank {i}: placed {len(chosen)} of {r} replicas")  # excluded by the node check
        peers[i] = list(chosen)
    _rebalance(peers, load, node_of, r)
    peers = {i: tuple(sorted(ps, key=lambda p: p not in group_of[i])) for i, ps in peers.items()}  # stable: DP first
    sources = {j: tuple(sorted(i for i in range(world) if j in peers[i])) for j in range(world)}
    return ReplicaPlan(peers=peers, sources=sources)


def _eligible(rank: int, receiver: int, peers: list[int], node_of: Sequence[int], replacing: int) -> bool:
    """``receiver`` may replace ``replacing`` among ``rank``'s peers without sharing a node."""
    others = {node_of[p] for p in peers if p != replacing} | {node_of[rank]}
    return receiver not in peers and node_of[receiver] not in others


def _rebalance(peers: dict[int, list[int]], load: list[int], node_of: Sequence[int], r: int) -> None:
    """Greedy placement can end with a receiver over ``r`` while another has room but was not eligible for
    the last ranks. Move one replica off each overloaded receiver, directly (``i: o -> u``) or through one
    intermediate rank (``k: q -> u`` then ``i: o -> q``), until no move helps."""
    world = len(node_of)
    changed = True
    while changed:
        changed = False
        over = [o for o in range(world) if load[o] > r]
        under = [u for u in range(world) if load[u] < r]
        for o in over:
            for i in (i for i in range(world) if o in peers[i]):
                move = next(((i, o, u) for u in under if _eligible(i, u, peers[i], node_of, o)), None)
                if move is None:
                    move2 = next(((k, q, u) for u in under for k in range(world) for q in peers[k]
                                  if q != o and _eligible(k, u, peers[k], node_of, q)
                                  and _eligible(i, q, peers[i], node_of, o)), None)
                    if move2 is None:
                        continue
                    k, q, u = move2
                    peers[k][peers[k].index(q)] = u
                    load[u] += 1
                    load[q] -= 1
                    move = (i, o, q)
                i, o, u = move
                peers[i][peers[i].index(o)] = u
                load[u] += 1
                load[o] -= 1
                changed = True
                break
            if changed:
                break


def has_copy_off_node(rank: int, group: Sequence[int], node_of: Sequence[int]) -> bool:
    """Whether a data-parallel replica of ``rank``'s state lives on another node."""
    return any(node_of[p] != node_of[rank] for p in group if p != rank)


def needs_replication(op: OperatorId, level: Level, *, dp_copy_off_node: bool, expert_dp_copy_off_node: bool,
                      distributed_optimizer: bool) -> bool:
    """MoEtion §5.1: state that data parallelism already keeps on another node is not sent again.

    Compute weights are identical on every data-parallel replica (expert-data-parallel for experts), and so
    are masters and optimizer state with a non-distributed optimizer; the distributed optimizer shards
    masters and optimizer state over the data-parallel ranks, so FULL entries must be replicated."""
    off_node = expert_dp_copy_off_node if op.is_expert else dp_copy_off_node
    if not off_node:
        return True
    if level == Level.COMPUTE:
        return False
    return distributed_optimizer
