"""Reconfiguration after failures, joins or rebalancing: Lazarus §4.3.

``map_nodes`` assigns the logical nodes of a new plan to physical nodes greedily: among all unmapped
(physical, logical) pairs it repeatedly takes the one with the fewest experts the physical node would have
to fetch (ties: lowest logical index, then lowest physical id), which is the paper's "iteratively maps a
physical node to a node in the new placement plan that the number of newly assigned experts is minimized".
A node fetches an expert once; further replicas of an expert it already holds are local copies, so the
cost of a pair is the number of *distinct* experts in the new node that the physical node does not hold.

``transfer_schedule`` then picks a source for every fetch among the surviving holders of the expert; the
fetches of one expert are dealt round-robin over all its holders, least-loaded holders first, so that each
holder of an expert serves ``floor`` or ``ceil`` of that expert's fetches ("distributes their state
transfers among all owning nodes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from moe_ft.placement.plans import Plan


@dataclass(frozen=True)
class ExpertTransfer:
    """Copy the state of ``expert_idx`` from physical node ``src`` to physical node ``dst``."""

    expert_idx: int
    src: int
    dst: int


def fetch_cost_matrix(
    held: Mapping[int, Sequence[int]], new_plan: Plan, num_experts: int
) -> tuple[list[int], np.ndarray]:
    """``(physical_ids, cost[physical, logical])``: distinct experts physical node must fetch to play logical."""
    physical = sorted(held)
    has = np.zeros((len(physical), num_experts), dtype=bool)
    for p_idx, p in enumerate(physical):
        has[p_idx, list(held[p])] = True
    needs = np.zeros((len(new_plan), num_experts), dtype=bool)
    for l_idx, node in enumerate(new_plan):
        needs[l_idx, list(node)] = True
    cost = needs.sum(axis=1)[None, :] - has.astype(np.int64) @ needs.T.astype(np.int64)
    return physical, cost


def map_nodes(held: Mapping[int, Sequence[int]], new_plan: Plan, num_experts: int) -> list[int]:
    """Physical node id for each logical node of ``new_plan``.

    ``held``: physical node id -> experts it holds now (empty for a node that just joined); it must list
    exactly ``len(new_plan)`` nodes, the ones that will run the new plan.
    """
    if len(held) != len(new_plan):
        raise ValueError(f"{len(held)} physical nodes available but the new plan has {len(new_plan)} nodes")
    physical, cost = fetch_cost_matrix(held, new_plan, num_experts)
    num = len(physical)
    # stable sort over (cost, logical, physical) == the greedy's choice order
    order = np.lexsort((np.tile(np.arange(num), num), np.repeat(np.arange(num), num), cost.T.reshape(-1)))
    mapping = [-1] * num
    used_physical = np.zeros(num, dtype=bool)
    mapped = 0
    for flat in order:
        l_idx, p_idx = divmod(int(flat), num)
        if mapping[l_idx] >= 0 or used_physical[p_idx]:
            continue
        mapping[l_idx] = physical[p_idx]
        used_physical[p_idx] = True
        mapped += 1
        if mapped == num:
            break
    return mapping


def num_fetches(held: Mapping[int, Sequence[int]], new_plan: Plan, mapping: Sequence[int]) -> int:
    """Distinct (node, expert) fetches the mapping requires."""
    return sum(len(set(node) - set(held[p])) for node, p in zip(new_plan, mapping))


def transfer_schedule(held: Mapping[int, Sequence[int]], new_plan: Plan, mapping: Sequence[int]) -> list[ExpertTransfer]:
    """One ``ExpertTransfer`` per expert a physical node must fetch; raises ``RuntimeError`` if an expert has no
    surviving holder (recovery needs a checkpoint then)."""
    holders: dict[int, list[int]] = {}
    for p in sorted(held):
        for e in sorted(set(held[p])):
            holders.setdefault(e, []).append(p)
    requests: dict[int, list[int]] = {}
    for node, p in zip(new_plan, mapping):
        for e in sorted(set(node) - set(held[p])):
            requests.setdefault(e, []).append(p)
    load = {p: 0 for p in held}
    transfers: list[ExpertTransfer] = []
    for e in sorted(requests):
        if e not in holders:
            raise RuntimeError(f"expert {e} has no surviving replica; restore it from a checkpoint")
        sources = sorted(holders[e], key=lambda p: (load[p], p))
        for k, dst in enumerate(requests[e]):
            src = sources[k % len(sources)]
            load[src] += 1
            transfers.append(ExpertTransfer(e, src, dst))
    return transfers
