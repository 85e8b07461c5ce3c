"""Placement plans: which expert replicas each node holds (Lazarus §4.1).

A plan is a tuple with one entry per node; each entry is the sorted tuple of expert ids in that node's
``c`` slots (an expert may occupy several slots of one node). Plans built here fill every slot, so the
allocation must satisfy ``sum(r) == N * c`` (eq. 1 guarantees it).

* ``mro_plan``  -- maximum rank overlap, implemented as the paper describes it (§4.1, App. A.2);
* ``spread_plan`` -- baseline: the replica list dealt round-robin over nodes (each expert on as many
  nodes as possible);
* ``compact_plan`` -- baseline: the replica list cut into consecutive blocks of ``c`` (each expert on as
  few nodes as possible).

Recovery depends only on each expert's *support* (the set of nodes holding it); see ``reliability.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

Plan = tuple[tuple[int, ...], ...]


def validate_allocation(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> None:
    """Raise ``ValueError`` unless ``replicas`` fills exactly ``num_nodes * slots_per_node`` slots."""
    if num_nodes < 1 or slots_per_node < 1:
        raise ValueError(f"need at least one node and one slot per node, got {num_nodes=} {slots_per_node=}")
    if any(r < 1 for r in replicas):
        raise ValueError(f"every expert needs at least one replica, got {list(replicas)}")
    if sum(replicas) != num_nodes * slots_per_node:
        raise ValueError(
            f"allocation {list(replicas)} has {sum(replicas)} replicas but {num_nodes} nodes x {slots_per_node} "
            f"slots = {num_nodes * slots_per_node}; compute it with allocate_replicas (eq. 1)"
        )


def validate_plan(plan: Plan, replicas: Sequence[int], slots_per_node: int) -> None:
    """Raise ``ValueError`` unless every node has ``slots_per_node`` replicas and the counts match."""
    for node_idx, node in enumerate(plan):
        if len(node) != slots_per_node:
            raise ValueError(f"node {node_idx} holds {len(node)} replicas, expected {slots_per_node}")
    counts = Counter(e for node in plan for e in node)
    expected = {e: r for e, r in enumerate(replicas) if r}
    if dict(counts) != expected:
        raise ValueError(f"plan holds replica counts {dict(sorted(counts.items()))}, allocation is {expected}")


def canonical(plan: Sequence[Sequence[int]]) -> Plan:
    """Each node's experts sorted; node order kept (it matters for node mapping, §4.3)."""
    return tuple(tuple(sorted(node)) for node in plan)


def plan_counts(plan: Plan, num_experts: int) -> np.ndarray:
    """``counts[node, expert]``: replicas of ``expert`` on ``node``; shape ``[num_nodes, num_experts]``."""
    counts = np.zeros((len(plan), num_experts), dtype=np.int64)
    for node_idx, node in enumerate(plan):
        for e in node:
            counts[node_idx, e] += 1
    return counts


def supports(plan: Plan, num_experts: int) -> list[frozenset[int]]:
    """``S_e``: the set of nodes that hold expert ``e``."""
    holders: list[set[int]] = [set() for _ in range(num_experts)]
    for node_idx, node in enumerate(plan):
        for e in node:
            holders[e].add(node_idx)
    return [frozenset(h) for h in holders]


def _replica_list(replicas: Sequence[int]) -> list[int]:
    return [e for e, r in enumerate(replicas) for _ in range(r)]


def spread_plan(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Plan:
    """Baseline: replica ``k`` of the expert-ordered replica list goes to node ``k mod N``."""
    validate_allocation(replicas, num_nodes, slots_per_node)
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    for k, e in enumerate(_replica_list(replicas)):
        nodes[k % num_nodes].append(e)
    return canonical(nodes)


def compact_plan(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Plan:
    """Baseline: node ``n`` takes replicas ``[n*c, (n+1)*c)`` of the expert-ordered replica list."""
    validate_allocation(replicas, num_nodes, slots_per_node)
    flat = _replica_list(replicas)
    return canonical([flat[n * slots_per_node : (n + 1) * slots_per_node] for n in range(num_nodes)])


def _fill_vacant(nodes: list[list[int]], left: list[int], order: list[int], slots_per_node: int) -> None:
    """"For the vacant slots, we uniformly place the experts that still have replicas left" (§4.1).

    Vacant slots are visited node by node; each takes the next expert, round-robin in ascending-load order,
    among those with replicas left -- so leftover replicas are spread over the nodes with vacancies.
    """
    pointer = 0
    for node in nodes:
        while len(node) < slots_per_node:
            assert any(left), "more vacant slots than leftover replicas"
            while left[order[pointer % len(order)]] == 0:
                pointer += 1
            e = order[pointer % len(order)]
            pointer += 1
            node.append(e)
            left[e] -= 1
    assert not any(left), "leftover replicas without a vacant slot"


def mro_plan(replicas: Sequence[int], num_nodes: int, slots_per_node: int) -> Plan:
    """Maximum rank overlap plan (Lazarus §4.1 and App. A.2), nodes numbered as the paper numbers them.

    Experts are ranked by replica count, ascending (ties by id). ``E <= c``: expert ``e`` goes on the first
    ``min(r_e, N)`` nodes, so ``S_1 ⊂ S_2 ⊂ ... ⊂ S_E``. ``E > c``: experts are cut into ``ceil(E/c)``
    consecutive groups of ``c``; group ``i`` gets the next ``r_{c(i-1)+1}`` nodes (the count of its least
    popular member, the "representative"; clipped to the nodes left) and each of those nodes holds one
    replica of every group member. Vacant slots then take the leftover replicas uniformly.

    The paper claims this plan maximises the recovery probability for any allocation (Theorem 1); that
    is false in general (see ``search.py`` and ``docs/placement.md``).
    """
    validate_allocation(replicas, num_nodes, slots_per_node)
    num_experts = len(replicas)
    order = sorted(range(num_experts), key=lambda e: (replicas[e], e))
    left = list(replicas)
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    if num_experts <= slots_per_node:
        for e in order:
            for node in nodes[: min(replicas[e], num_nodes)]:
                node.append(e)
                left[e] -= 1
    else:
        next_node = 0
        for start in range(0, num_experts, slots_per_node):
            group = order[start : start + slots_per_node]
            size = min(replicas[group[0]], num_nodes - next_node)
            for node in nodes[next_node : next_node + size]:
                for e in group:
                    node.append(e)
                    left[e] -= 1
            next_node += size
    _fill_vacant(nodes, left, order, slots_per_node)
    return canonical(nodes)


STRATEGIES_BASELINE = {"mro": mro_plan, "spread": spread_plan, "compact": compact_plan}
