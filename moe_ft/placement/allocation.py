"""Replica allocation from expert loads: Lazarus §4.1, eq. (1).

Experts are visited in ascending order of load ``t_e`` and each receives

    r_e = max(floor(t_e / sum_{e' >= e} t_e' * (N*c - sum_{e' < e} r_e')), f)

replicas. Because loads are visited in ascending order, ``t_e`` is at most the mean of the loads still to
be served, so ``r_e <= max(rem / k, f)`` with ``k`` experts left; if ``rem >= k*f`` the experts that follow
still find ``f`` slots each. The last expert takes the remainder, hence ``sum_e r_e = N*c`` exactly.
Ties in load keep the order in which the experts were given (stable sort). When every remaining load is
zero the remaining slots are split evenly (the paper's ratio is 0/0 there).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence


def held_fault_threshold(min_replicas: int, *, num_nodes: int, slots_per_node: int, num_experts: int) -> int:
    """The ``f`` eq. 1 can keep on ``num_nodes`` x ``slots_per_node`` slots: ``min_replicas`` (the flag), lowered
    to ``N x c // E`` when the slots cannot give every expert that many (a shrunken world, Lazarus §4.3), never
    below 1 (a world without a slot per expert is :func:`allocate_replicas`'s error). Every planner of an
    elastic job (restart, fallback, in-run rebalance) takes this one value, so they agree on the world."""
    return max(1, min(min_replicas, num_nodes * slots_per_node // max(1, num_experts)))


def allocate_replicas(
    loads: Sequence[float], *, num_nodes: int, slots_per_node: int, min_replicas: int
) -> list[int]:
    """Replicas per expert, in the order ``loads`` were given (Lazarus eq. 1).

    ``loads``: tokens routed to each expert (non-negative); ``min_replicas``: the fault-tolerance threshold
    ``f`` (every expert survives any ``f - 1`` node failures). Returns ``r`` with ``sum(r) == num_nodes *
    slots_per_node``, ``r_e >= min_replicas`` and ``r`` non-decreasing in load.
    """
    num_experts = len(loads)
    if num_experts == 0:
        raise ValueError("loads is empty: give one load per expert, e.g. --loads 40,30,20,10")
    if num_nodes < 1 or slots_per_node < 1:
        raise ValueError(f"need at least one node and one slot per node, got {num_nodes=} {slots_per_node=}")
    if min_replicas < 1:
        raise ValueError(f"the fault-tolerance threshold f must be >= 1 (every expert needs a replica), got {min_replicas}")
    if any(not (t >= 0) for t in loads):  # also rejects NaN
        raise ValueError(f"loads must be non-negative numbers, got {list(loads)}")
    total_slots = num_nodes * slots_per_node
    if total_slots < num_experts * min_replicas:
        raise ValueError(
            f"{num_nodes} nodes x {slots_per_node} slots = {total_slots} slots cannot hold {num_experts} experts x "
            f"f={min_replicas} replicas = {num_experts * min_replicas}; add nodes or slots, or lower f"
        )
    order = sorted(range(num_experts), key=lambda e: loads[e])
    replicas = [0] * num_experts
    remaining_slots = total_slots
    exact_loads = [Fraction(t) for t in loads]  # exact floor: no float drift in the running sums
    remaining_load = sum(exact_loads, Fraction(0))
    for k, e in enumerate(order):
        left = num_experts - k
        if k == num_experts - 1:
            share = remaining_slots
        elif remaining_load > 0:
            share = int(exact_loads[e] * remaining_slots / remaining_load)
        else:
            share = remaining_slots // left
        r = max(share, min_replicas)
        assert remaining_slots - r >= (left - 1) * min_replicas, "eq. 1 invariant violated"
        replicas[e] = r
        remaining_slots -= r
        remaining_load -= exact_loads[e]
    assert sum(replicas) == total_slots
    return replicas
