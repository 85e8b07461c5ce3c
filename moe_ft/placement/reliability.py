"""Exact probability that every expert survives when ``R`` of ``N`` nodes stay alive (Lazarus §4.1).

The alive set is a uniformly random ``R``-subset of the nodes; equivalently ``k = N - R`` nodes fail. The
plan recovers iff no expert has its whole support ``S_e`` inside the failed set. Only *minimal* supports
matter (if ``S_a ⊆ S_b`` then losing ``b`` implies losing ``a``), and minimal supports that share no node
fail independently given the failed set's size. So the supports are cut into connected components (two
supports are joined when they share a node) and, per component with node set ``V``, the polynomial

    a_V(x) = sum_j  #{ j-subsets of V that contain no support of the component } x^j

is computed exactly -- in closed form ``(1+x)^s - x^s`` for a single support of ``s`` nodes (the MRO
structure: the group representatives' supports are disjoint), otherwise by inclusion–exclusion over the
component's supports or by enumerating the subsets of ``V``, whichever is cheaper. Then

    #{ failed k-sets that recover } = [x^k]  (1+x)^{N - |∪V|}  prod_V a_V(x),

and dividing by ``C(N, k)`` gives the exact probability (a ``Fraction``) for every ``k`` at once. When a
component is too large for both exact methods, a seeded Monte-Carlo estimate with a 95 % Wilson interval
is returned instead, and ``method`` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from typing import Sequence

import numpy as np

from moe_ft.placement.plans import Plan, supports

METHODS = ("closed_form", "inclusion_exclusion", "enumeration", "monte_carlo")


@dataclass(frozen=True)
class RecoveryEstimate:
    """``probability`` of full recovery with ``num_failed`` failed nodes; ``exact`` is the Fraction when
    ``method`` is exact (``closed_form``, ``inclusion_exclusion``, ``enumeration``), else ``None``;
    ``ci_low``/``ci_high``: 95 % Wilson interval for ``monte_carlo`` (equal to ``probability`` when exact)."""

    num_failed: int
    probability: float
    method: str
    exact: Fraction | None
    ci_low: float
    ci_high: float
    num_samples: int = 0


@dataclass(kw_only=True, frozen=True)
class ReliabilityConfig:
    """How hard to try for an exact answer before falling back to Monte Carlo."""

    max_exact_terms: int = 1 << 16
    """Largest ``2^m`` (inclusion–exclusion over ``m`` supports) or ``2^|V|`` (subset enumeration) per component."""
    mc_samples: int = 20000
    """Monte-Carlo samples per number of failed nodes when no exact method fits."""
    seed: int = 0
    """Seed of the Monte-Carlo sampler."""


def _poly_mul(a: list[int], b: list[int], max_degree: int) -> list[int]:
    out = [0] * min(len(a) + len(b) - 1, max_degree + 1)
    for i, x in enumerate(a[: max_degree + 1]):
        if x:
            for j, y in enumerate(b[: max_degree + 1 - i]):
                out[i + j] += x * y
    return out


def _binomial_row(n: int, max_degree: int | None = None) -> list[int]:
    top = n if max_degree is None else min(n, max_degree)
    row = [1] * (top + 1)
    for j in range(1, top + 1):
        row[j] = row[j - 1] * (n - j + 1) // j
    return row


def minimal_supports(sets: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """Distinct supports that contain no other support."""
    unique = sorted(set(sets), key=lambda s: (len(s), sorted(s)))
    kept: list[frozenset[int]] = []
    for s in unique:
        if not any(k <= s for k in kept):
            kept.append(s)
    return kept


def _components(sets: list[frozenset[int]]) -> list[list[frozenset[int]]]:
    parent = list(range(len(sets)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, s in enumerate(sets):
        for node in s:
            if node in owner:
                parent[find(i)] = find(owner[node])
            else:
                owner[node] = i
    groups: dict[int, list[frozenset[int]]] = {}
    for i, s in enumerate(sets):
        groups.setdefault(find(i), []).append(s)
    return list(groups.values())


def _component_poly(sets: list[frozenset[int]], max_terms: int, max_degree: int) -> tuple[list[int], str] | None:
    nodes = sorted(set().union(*sets))
    v = len(nodes)
    if len(sets) == 1:
        poly = _binomial_row(v, max_degree)
        if v <= max_degree:
            poly[v] -= 1  # (1+x)^s - x^s
        return poly, "closed_form"
    m = len(sets)
    if (1 << m) <= (1 << v) and (1 << m) <= max_terms:
        # inclusion–exclusion: sum_J (-1)^|J| x^|U_J| (1+x)^(v-|U_J|)
        weight = [0] * (v + 1)
        for size in range(m + 1):
            for subset in combinations(sets, size):
                union = len(frozenset().union(*subset)) if subset else 0
                weight[union] += -1 if size % 2 else 1
        poly = [0] * (v + 1)
        for u, w in enumerate(weight):
            if w:
                for j, c in enumerate(_binomial_row(v - u)):
                    poly[u + j] += w * c
        return poly, "inclusion_exclusion"
    if (1 << v) <= max_terms:
        local = {node: i for i, node in enumerate(nodes)}
        masks = np.arange(1 << v, dtype=np.int64)
        bad = np.zeros(1 << v, dtype=bool)
        for s in sets:
            smask = sum(1 << local[n] for n in s)
            bad |= (masks & smask) == smask
        popcount = np.zeros(1 << v, dtype=np.int64)
        for bit in range(v):
            popcount += (masks >> bit) & 1
        poly = np.bincount(popcount[~bad], minlength=v + 1).tolist()
        return [int(x) for x in poly], "enumeration"
    return None


def recovering_failure_sets(
    support_sets: Sequence[frozenset[int]], num_nodes: int, max_exact_terms: int = 1 << 16, max_failed: int | None = None
) -> tuple[list[int], str] | None:
    """``(counts, method)`` with ``counts[k]`` = number of failed ``k``-subsets that recover, for ``k`` in
    ``0..max_failed`` (default ``N``), or ``None`` when a component is too large for an exact method."""
    max_failed = num_nodes if max_failed is None else max_failed
    sets = minimal_supports(support_sets)
    if any(len(s) == 0 for s in sets):
        return [0] * (max_failed + 1), "closed_form"
    covered = set().union(*sets) if sets else set()
    total = _binomial_row(num_nodes - len(covered), max_failed)
    rank = METHODS.index("closed_form")
    for comp in _components(sets):
        result = _component_poly(comp, max_exact_terms, max_failed)
        if result is None:
            return None
        poly, method = result
        rank = max(rank, METHODS.index(method))
        total = _poly_mul(total, poly, max_failed)
    return total + [0] * (max_failed + 1 - len(total)), METHODS[rank]


def _wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _monte_carlo(sets: list[frozenset[int]], num_nodes: int, num_failed: int, config: ReliabilityConfig) -> RecoveryEstimate:
    rng = np.random.default_rng([config.seed, num_nodes, num_failed])
    member = np.zeros((len(sets), num_nodes), dtype=bool)
    for i, s in enumerate(sets):
        member[i, list(s)] = True
    sizes = member.sum(axis=1)
    ok = 0
    for start in range(0, config.mc_samples, 1024):
        batch = min(1024, config.mc_samples - start)
        keys = rng.random((batch, num_nodes))
        failed = np.zeros((batch, num_nodes), dtype=bool)
        if num_failed:
            idx = np.argpartition(keys, num_failed - 1, axis=1)[:, :num_failed]
            np.put_along_axis(failed, idx, True, axis=1)
        lost = (failed.astype(np.int32) @ member.T.astype(np.int32)) == sizes[None, :]
        ok += int((~lost.any(axis=1)).sum())
    lo, hi = _wilson(ok, config.mc_samples)
    return RecoveryEstimate(num_failed, ok / config.mc_samples, "monte_carlo", None, lo, hi, config.mc_samples)


def recovery_probabilities(
    plan: Plan, num_experts: int, failed: Sequence[int] | None = None, config: ReliabilityConfig | None = None
) -> dict[int, RecoveryEstimate]:
    """Recovery probability for each number of failed nodes in ``failed`` (default ``0..N-1``)."""
    config = config or ReliabilityConfig()
    num_nodes = len(plan)
    ks = list(range(num_nodes)) if failed is None else list(failed)
    for k in ks:
        if not 0 <= k <= num_nodes:
            raise ValueError(f"number of failed nodes must be in [0, {num_nodes}], got {k}")
    sets = supports(plan, num_experts)
    exact = recovering_failure_sets(sets, num_nodes, config.max_exact_terms, max(ks, default=0))
    out: dict[int, RecoveryEstimate] = {}
    for k in ks:
        if exact is not None:
            counts, method = exact
            frac = Fraction(counts[k], math.comb(num_nodes, k))
            out[k] = RecoveryEstimate(k, float(frac), method, frac, float(frac), float(frac))
        else:
            out[k] = _monte_carlo(minimal_supports(sets), num_nodes, k, config)
    return out


def recovery_vector(plan: Plan, num_experts: int, max_exact_terms: int = 1 << 16) -> list[Fraction] | None:
    """Exact ``[P(k failed) for k in 0..N]``, or ``None`` when no exact method fits."""
    num_nodes = len(plan)
    exact = recovering_failure_sets(supports(plan, num_experts), num_nodes, max_exact_terms)
    if exact is None:
        return None
    return [Fraction(c, math.comb(num_nodes, k)) for k, c in enumerate(exact[0])]


def recovery_probability_brute_force(plan: Plan, num_experts: int, num_failed: int) -> Fraction:
    """Cross-check: enumerate every failed ``k``-subset of nodes directly from the plan."""
    num_nodes = len(plan)
    good = 0
    for failed in combinations(range(num_nodes), num_failed):
        dead = set(failed)
        alive_experts = {e for n, node in enumerate(plan) if n not in dead for e in node}
        good += len(alive_experts) == num_experts
    return Fraction(good, math.comb(num_nodes, num_failed))
