"""The decision policy of ``moe-ft launch``: pure functions of the agents' view of the job (no store, no
process), which the agent's mechanism carries out. Which process takes each dead rank; where each rank
of a round lives; whether an announced attempt spent a restart; whether the job may shrink, wait for a
replacement node, or grow keeping its workers.
"""

from __future__ import annotations


def rank_homes(groups: dict[int, int], *, per_node: int, world_size: int, attempt: int) -> dict[int, int]:
    """Rank → the node of this rendezvous round that runs it, from ``groups`` (round node → its place in the
    layout: the identity, or what a replacement's attempt announced). Every place of the layout must have a
    node: a mapping that leaves one out (an announcement from another round, or two nodes in one place)
    raises naming it instead of leaving ranks without a home."""
    places = list(range(-(-world_size // per_node)))
    taken: dict[int, list[int]] = {}
    for node, place in groups.items():
        taken.setdefault(place, []).append(node)
    missing = [p for p in places if p not in taken]
    shared = {p: ns for p, ns in taken.items() if len(ns) > 1}
    if missing or shared:
        raise RuntimeError(f"moe-ft launch: attempt {attempt} places the round's nodes at {dict(sorted(groups.items()))} "
                           f"(node -> place in the layout of {len(places)} places of {per_node} ranks)"
                           + (f"; no node at place(s) {missing}" if missing else "")
                           + (f"; several nodes at {shared}" if shared else "")
                           + ": the ranks there would have no process. Restart the job (torchrun restarts it from "
                             "its snapshots); please report this with the launch logs")
    place_node = {place: nodes[0] for place, nodes in taken.items()}
    return {rank: place_node[rank // per_node] for rank in range(world_size)}


def plan_replacements(dead: list[int], *, node: int, holders: dict[int, int], local_spares: int, free_devices: int,
                      remote_spares: int) -> tuple[list[tuple[int, str]], list[int]]:
    """Which process takes each dead rank (the policy of ``SpareAgent._assign``; pure). ``node``: the
    deciding agent's; ``holders``: rank → the node that ran it. In order:

    * the ranks of other nodes (a lost node's) first: they can go only to spares, this node's
      (``"local"``) then those other nodes list (``"remote"``);
    * this node's own dead ranks: a local spare, else a fresh process on a free device of this node
      (``"fresh"``: the rank's state is in this node's store, a warm spare elsewhere would have to fetch
      it), else a remote spare.

    Returns ``([(rank, source)], ranks left without a process)``. When the spares cannot take every other
    node's rank, nothing is planned and those left over are returned (the caller shrinks or falls back)."""
    others = [r for r in dead if holders.get(r) != node]
    if len(others) > local_spares + remote_spares:
        return [], others[local_spares + remote_spares:]
    plan: list[tuple[int, str]] = []
    missing: list[int] = []
    for rank in others + [r for r in dead if r not in others]:
        if local_spares:
            local_spares -= 1
            plan.append((rank, "local"))
        elif rank not in others and free_devices:
            free_devices -= 1
            plan.append((rank, "fresh"))
        elif remote_spares:
            remote_spares -= 1
            plan.append((rank, "remote"))
        else:
            missing.append(rank)
    return plan, missing


def spends_restart(info: dict) -> bool:
    """Whether an announced attempt spent one of ``--max-restarts`` (it replaced failed ranks in process, or
    made the survivors wait for a replacement node; a grow spends none)."""
    return info.get("kind") == "await" or (info.get("kind") == "inprocess" and bool(info.get("failed")))


def only_lost_nodes(dead: list[int], *, home: dict[int, int], holders: dict[int, int], lost: set[int]) -> bool:
    """Every dead rank is a lost node's, and every live rank runs on its layout node (``home``; ``holders``:
    where it runs now), a live one (no earlier cross-node take-over): the lost nodes' places can be dropped
    (shrink) or refilled (replacement node) whole. A live rank of a lost node runs on another node's former
    spare: a shrink would drop its place and leave its process running outside the job."""
    return (all(home.get(r) in lost for r in dead)
            and all(holders.get(r) == n and n not in lost for r, n in home.items() if r not in dead))


def can_shrink(dead: list[int], *, min_nodes: int, nodes: int, lost: set[int], home: dict[int, int],
               holders: dict[int, int], stood_by: list[int]) -> bool:
    """``--nnodes MIN:MAX`` (``min_nodes``: MIN) with the lost nodes' ranks ``dead`` and no spare for them: the
    job shrinks when the layout stays contiguous (:func:`only_lost_nodes`), at least MIN nodes are left, and
    no rank stood by (``stood_by``: a stood-by rank has no process to renumber)."""
    if stood_by:
        return False
    live = [n for n in range(nodes) if n not in lost]
    return len(live) >= max(min_nodes, 1) and only_lost_nodes(dead, home=home, holders=holders, lost=lost)


def can_await(dead: list[int], *, min_nodes: int | None, nodes: int, lost: set[int], home: dict[int, int],
              holders: dict[int, int], stood_by: list[int]) -> bool:
    """A fixed ``--nnodes N`` (``min_nodes`` ``None``) whose lost nodes' ranks no spare can take: the survivors
    wait in their processes for replacement nodes when every dead rank is a lost node's, every rank of the
    lost nodes is dead, every live rank runs on its layout node (the replacement then takes exactly the lost
    nodes' places), and no rank stood by."""
    return (min_nodes is None and nodes > 1 and bool(lost) and not stood_by
            and only_lost_nodes(dead, home=home, holders=holders, lost=lost)
            and {r for r, n in home.items() if n in lost} <= set(dead))


def shrunk_layout(*, nodes: int, lost: set[int], home: dict[int, int], per_node: int) -> dict:
    """The job without the lost nodes (an announcement's ``resize``): the live nodes keep their order
    (``nodes``: node → its new group rank), their ranks are renumbered contiguously (``ranks``: old → new),
    ``world_size`` is smaller."""
    live = [n for n in range(nodes) if n not in lost]
    index = {n: i for i, n in enumerate(live)}
    ranks = {r: index[n] * per_node + r % per_node for r, n in home.items() if n in index}
    return {"ranks": ranks, "world_size": len(live) * per_node, "nodes": index}


def may_grow(*, min_nodes: int | None, max_nodes: int, nodes: int, lost: set[int]) -> bool:
    """``--nnodes MIN:MAX`` (``min_nodes`` not ``None``) with fewer than MAX nodes live: a node waiting at the
    rendezvous may join."""
    return min_nodes is not None and nodes - len(lost) < max_nodes


def layout_intact(*, node: int, per_node: int, dead: dict[int, float], home: dict[int, int],
                  devices: dict[int, int]) -> bool:
    """Every rank of ``node`` runs there on its own device (``devices``: rank → device index of this node's
    workers), nothing dead: the workers can keep their processes when the job grows."""
    return (not dead and len(devices) == per_node and all(home.get(r) == node for r in devices)
            and sorted(devices.values()) == list(range(per_node)))
