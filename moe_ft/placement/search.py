"""The ``optimal`` placement strategy: never worse than MRO, spread or compact.

Lazarus Theorem 1 (§4.1, App. A.2) claims MRO maximises the recovery probability for every allocation.
It does not: for ``r = [2, 2, 2, 3]``, ``N = 3``, ``c = 3`` MRO builds ``{1,2,3}, {1,2,3}, {4,4,4}`` and
survives one failed node with probability 2/3, while ``{1,2,4}, {1,3,4}, {2,3,4}`` survives any single
failure: the leftover replicas of the last expert fill a node of their own, a single point of failure.

Objective. Plans are compared by the vector of exact recovery probabilities, lexicographically, in the
order ``(target, 1, 2, ..., K)``: the number of failed nodes asked for (if any) first, then ascending
numbers of failures -- fewer simultaneous failures are far more likely, so they decide first.
``K = min(N - 1, max_objective_failures)``.

Search. Exact search enumerates every plan up to a permutation of the nodes (node contents as sorted
multisets, nodes in non-decreasing lexicographic order) when there are at most ``max_exact_plans`` of
them. Otherwise a local search starts from the best of MRO, spread and compact and accepts only strict
improvements of single replica swaps between two nodes, within ``max_evaluations`` evaluations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import Sequence

from moe_ft.placement.plans import Plan, canonical, compact_plan, mro_plan, spread_plan, supports, validate_allocation
from moe_ft.placement.reliability import recovering_failure_sets

MAX_EXACT_NODES = 16
MAX_EXACT_NODE_KINDS = 5000


@dataclass(kw_only=True, frozen=True)
class SearchConfig:
    """Budgets of the ``optimal`` strategy."""

    target_failures: int | None = None
    """Number of failed nodes whose recovery probability is maximised first (``None``: ascending order)."""
    max_objective_failures: int = 16
    """Largest number of failed nodes that enters the objective."""
    max_exact_plans: int = 20000
    """Exact search is attempted when the symmetry-reduced plan count is at most this."""
    max_evaluations: int = 500
    """Plans the local search may evaluate."""
    max_exact_terms: int = 1 << 16
    """Passed to the exact recovery computation (see ``reliability.py``)."""


@dataclass(frozen=True)
class SearchResult:
    """``plan``; ``method``: ``exact`` (provably optimal for the objective) or ``local`` (local optimum or
    budget reached); ``start``: the baseline the local search started from; ``evaluations``."""

    plan: Plan
    method: str
    start: str
    evaluations: int


def _objective_failures(num_nodes: int, config: SearchConfig) -> list[int]:
    ks = list(range(1, min(num_nodes - 1, config.max_objective_failures) + 1))
    if config.target_failures is not None:
        if not 0 <= config.target_failures <= num_nodes:
            raise ValueError(f"target_failures must be in [0, {num_nodes}], got {config.target_failures}")
        ks = [config.target_failures] + [k for k in ks if k != config.target_failures]
    return ks


class _Objective:
    """Exact objective key of a plan (tuples of recovering-set counts; same ``N`` so counts compare like
    probabilities). Memoised by the supports, which is all recovery depends on."""

    def __init__(self, num_nodes: int, num_experts: int, config: SearchConfig):
        self.num_nodes, self.num_experts = num_nodes, num_experts
        self.ks = _objective_failures(num_nodes, config)
        self.max_terms = config.max_exact_terms
        self.cache: dict[tuple, tuple[int, ...] | None] = {}
        self.evaluations = 0

    def __call__(self, plan: Plan) -> tuple[int, ...] | None:
        sets = supports(plan, self.num_experts)
        key = tuple(sorted(tuple(sorted(s)) for s in sets))
        if key not in self.cache:
            self.cache[key] = self.of_supports(sets)
        return self.cache[key]

    def of_supports(self, sets: Sequence[frozenset[int]] | Sequence[set[int]]) -> tuple[int, ...] | None:
        self.evaluations += 1
        exact = recovering_failure_sets(
            [frozenset(s) for s in sets], self.num_nodes, self.max_terms, max(self.ks, default=0)
        )
        return None if exact is None else tuple(exact[0][k] for k in self.ks)


def _better(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    return a is not None and (b is None or a > b)


def enumerate_plans(replicas: Sequence[int], num_nodes: int, slots_per_node: int, limit: int | None = None):
    """Every plan up to node permutation; raises ``OverflowError`` after ``limit`` plans."""
    options = [
        combo for combo in combinations_with_replacement(range(len(replicas)), slots_per_node)
        if all(combo.count(e) <= replicas[e] for e in set(combo))
    ]
    counts = [tuple(combo.count(e) for e in range(len(replicas))) for combo in options]
    emitted = 0
    chosen: list[int] = []

    def rec(first_option: int, left: tuple[int, ...], nodes_left: int):
        nonlocal emitted
        if nodes_left == 0:
            emitted += 1
            if limit is not None and emitted > limit:
                raise OverflowError(f"more than {limit} plans")
            yield tuple(options[i] for i in chosen)
            return
        for i in range(first_option, len(options)):
            if all(c <= l for c, l in zip(counts[i], left)):
                chosen.append(i)
                yield from rec(i, tuple(l - c for c, l in zip(counts[i], left)), nodes_left - 1)
                chosen.pop()

    yield from rec(0, tuple(replicas), num_nodes)


def _exact_search(replicas, num_nodes, slots_per_node, objective, limit) -> Plan | None:
    node_kinds = math.comb(len(replicas) + slots_per_node - 1, slots_per_node)
    if limit <= 0 or num_nodes > MAX_EXACT_NODES or node_kinds > MAX_EXACT_NODE_KINDS:
        return None  # hopeless before enumerating: the count of plans grows like node_kinds^N / N!
    best, best_key = None, None
    try:
        for plan in enumerate_plans(replicas, num_nodes, slots_per_node, limit):
            key = objective(plan)
            if _better(key, best_key):
                best, best_key = plan, key
    except OverflowError:
        return None
    return best


def _swap(nodes, holders, i, a, j, b) -> None:
    """Move one ``a`` from node ``i`` to node ``j`` and one ``b`` from ``j`` to ``i``; keep supports in sync."""
    nodes[i][nodes[i].index(a)] = b
    nodes[j][nodes[j].index(b)] = a
    holders[a].add(j)
    holders[b].add(i)
    if a not in nodes[i]:
        holders[a].discard(i)
    if b not in nodes[j]:
        holders[b].discard(j)


def _local_search(start: Plan, objective: _Objective, budget: int) -> Plan:
    nodes = [list(n) for n in start]
    holders = [set(s) for s in supports(start, objective.num_experts)]
    best_key = objective.of_supports(holders)
    improved = True
    while improved and objective.evaluations < budget:
        improved = False
        # Wasted replicas (a second copy of an expert on the same node) are tried first: moving one adds
        # a node to some support without removing any.
        sources = sorted(
            ((i, a) for i, node in enumerate(nodes) for a in sorted(set(node))),
            key=lambda ia: (nodes[ia[0]].count(ia[1]) < 2, ia),
        )
        for i, a in sources:
            for j in range(len(nodes)):
                if j == i:
                    continue
                for b in sorted(set(nodes[j])):
                    if b == a:
                        continue
                    _swap(nodes, holders, i, a, j, b)
                    key = objective.of_supports(holders)
                    if _better(key, best_key):
                        best_key, improved = key, True
                        break
                    _swap(nodes, holders, i, b, j, a)  # undo
                    if objective.evaluations >= budget:
                        return canonical(nodes)
                if improved:
                    break
            if improved:
                break
    return canonical(nodes)


def optimal_plan(
    replicas: Sequence[int], num_nodes: int, slots_per_node: int, config: SearchConfig | None = None
) -> SearchResult:
    """Best plan for the objective above; never worse than MRO, spread or compact under it."""
    config = config or SearchConfig()
    validate_allocation(replicas, num_nodes, slots_per_node)
    objective = _Objective(num_nodes, len(replicas), config)
    exact = _exact_search(replicas, num_nodes, slots_per_node, objective, config.max_exact_plans)
    if exact is not None:
        return SearchResult(exact, "exact", "", objective.evaluations)
    baselines = {
        "mro": mro_plan(replicas, num_nodes, slots_per_node),
        "spread": spread_plan(replicas, num_nodes, slots_per_node),
        "compact": compact_plan(replicas, num_nodes, slots_per_node),
    }
    start_name = "mro"
    for name, plan in baselines.items():
        if _better(objective(plan), objective(baselines[start_name])):
            start_name = name
    budget = objective.evaluations + config.max_evaluations
    plan = _local_search(baselines[start_name], objective, budget)
    return SearchResult(plan, "local", start_name, objective.evaluations)
