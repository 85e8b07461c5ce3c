"""Allocation (eq. 1), MRO/spread/compact, exact recovery probability and the ``optimal`` search."""

import math
import random
from fractions import Fraction
from itertools import permutations

import pytest

from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.plans import compact_plan, mro_plan, spread_plan, supports, validate_plan
from moe_ft.placement.reliability import (
    ReliabilityConfig,
    recovery_probabilities,
    recovery_probability_brute_force,
    recovery_vector,
)
from moe_ft.placement.search import SearchConfig, enumerate_plans, optimal_plan


def _random_allocation(rng, num_nodes, slots, num_experts, f=1):
    loads = [rng.choice([0, 1, 2, 5, 10, 40]) * rng.randint(1, 9) for _ in range(num_experts)]
    return allocate_replicas(loads, num_nodes=num_nodes, slots_per_node=slots, min_replicas=f)


def test_allocation_example_and_invariants():
    assert allocate_replicas([40, 30, 20, 10], num_nodes=5, slots_per_node=4, min_replicas=1) == [8, 6, 4, 2]
    rng = random.Random(0)
    for _ in range(300):
        n, c, e = rng.randint(1, 12), rng.randint(1, 6), rng.randint(1, 10)
        f = rng.randint(1, 3)
        if n * c < e * f:
            continue
        loads = [rng.choice([0, 0.5, 3, 17, 100]) for _ in range(e)]
        r = allocate_replicas(loads, num_nodes=n, slots_per_node=c, min_replicas=f)
        assert sum(r) == n * c and min(r) >= f
        by_load = sorted(range(e), key=lambda i: loads[i])
        assert all(r[a] <= r[b] for a, b in zip(by_load, by_load[1:])), (loads, r)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loads=[1, 2, 3], num_nodes=1, slots_per_node=2, min_replicas=1), "cannot hold"),
        (dict(loads=[1, -2], num_nodes=2, slots_per_node=2, min_replicas=1), "non-negative"),
        (dict(loads=[1, 2], num_nodes=2, slots_per_node=2, min_replicas=0), "threshold"),
        (dict(loads=[], num_nodes=2, slots_per_node=2, min_replicas=1), "empty"),
    ],
)
def test_allocation_errors(kwargs, message):
    loads = kwargs.pop("loads")
    with pytest.raises(ValueError, match=message):
        allocate_replicas(loads, **kwargs)


def test_counterexample_to_theorem_1():
    replicas = [2, 2, 2, 3]
    mro = mro_plan(replicas, 3, 3)
    assert mro == ((0, 1, 2), (0, 1, 2), (3, 3, 3))
    assert recovery_probabilities(mro, 4, [1])[1].exact == Fraction(2, 3)
    better = ((0, 1, 3), (0, 2, 3), (1, 2, 3))
    assert recovery_probability_brute_force(better, 4, 1) == 1
    result = optimal_plan(replicas, 3, 3)
    assert result.method == "exact"
    assert recovery_probabilities(result.plan, 4, [1])[1].exact == 1
    # the local search, started from MRO, finds the improvement too
    local = optimal_plan(replicas, 3, 3, SearchConfig(max_exact_plans=0))
    assert local.method == "local" and recovery_probability_brute_force(local.plan, 4, 1) == 1


def test_mro_structure():
    # E <= c: nested supports S_1 ⊂ S_2 ⊂ ... in ascending replica order
    r = [4, 2, 3]
    plan = mro_plan(r, 3, 3)
    validate_plan(plan, r, 3)
    s = supports(plan, 3)
    assert s[1] <= s[2] <= s[0]
    # E > c: representatives' supports disjoint, each group nested on its representative's nodes
    r = allocate_replicas([1, 2, 3, 4, 5, 6], num_nodes=6, slots_per_node=3, min_replicas=2)
    plan = mro_plan(r, 6, 3)
    validate_plan(plan, r, 3)
    order = sorted(range(6), key=lambda e: (r[e], e))
    s = supports(plan, 6)
    reps = [order[0], order[3]]
    assert not (s[reps[0]] & s[reps[1]])
    assert all(s[reps[0]] <= s[e] for e in order[:3]) and all(s[reps[1]] <= s[e] for e in order[3:])
    assert {recovery_probabilities(plan, 6)[k].method for k in range(6)} == {"closed_form"}


def test_exact_recovery_matches_brute_force_on_random_plans():
    rng = random.Random(1)
    for _ in range(40):
        n, c, e = rng.randint(2, 7), rng.randint(1, 4), rng.randint(1, 6)
        if n * c < e:
            continue
        r = _random_allocation(rng, n, c, e)
        flat = [x for x, k in enumerate(r) for _ in range(k)]
        rng.shuffle(flat)
        plan = tuple(tuple(sorted(flat[i * c : (i + 1) * c])) for i in range(n))
        vec = recovery_vector(plan, e)
        for k in range(n + 1):
            assert vec[k] == recovery_probability_brute_force(plan, e, k), (plan, k)
        # the enumeration path (force it by forbidding inclusion–exclusion's larger term count) agrees too
        est = recovery_probabilities(plan, e, config=ReliabilityConfig(max_exact_terms=1 << n))
        assert all(est[k].exact == vec[k] for k in range(n))


def test_monte_carlo_fallback_is_labelled_and_covers_exact_value():
    # a cycle: expert i on nodes i and i+1 -- one component of overlapping minimal supports
    plan = tuple(tuple(sorted((i, (i - 1) % 8))) for i in range(8))
    exact = recovery_vector(plan, 8)
    est = recovery_probabilities(plan, 8, [2, 3, 5], ReliabilityConfig(max_exact_terms=1, mc_samples=4000, seed=3))
    for k, estimate in est.items():
        assert estimate.method == "monte_carlo" and estimate.exact is None and estimate.num_samples == 4000
        assert estimate.ci_low <= float(exact[k]) <= estimate.ci_high
        assert estimate.ci_high - estimate.ci_low < 0.05
    assert 0 < est[2].probability < 1 and est[5].probability == 0


def _brute_force_best(replicas, num_nodes, slots, ks):
    """Best objective over every assignment of the replica list to slots (no symmetry reduction)."""
    flat = [e for e, k in enumerate(replicas) for _ in range(k)]
    best = None
    for perm in set(permutations(flat)):
        plan = tuple(tuple(sorted(perm[i * slots : (i + 1) * slots])) for i in range(num_nodes))
        vec = recovery_vector(plan, len(replicas))
        key = tuple(vec[k] for k in ks)
        best = key if best is None or key > best else best
    return best


@pytest.mark.parametrize(
    "replicas, num_nodes, slots, target",
    [([2, 2, 2, 3], 3, 3, None), ([1, 2, 3], 3, 2, None), ([2, 2, 4], 4, 2, 2), ([1, 1, 2, 4], 4, 2, None),
     ([2, 3, 3], 4, 2, 3)],
)
def test_optimal_equals_brute_force_optimum(replicas, num_nodes, slots, target):
    ks = ([target] if target is not None else []) + [k for k in range(1, num_nodes) if k != target]
    result = optimal_plan(replicas, num_nodes, slots, SearchConfig(target_failures=target))
    assert result.method == "exact"
    vec = recovery_vector(result.plan, len(replicas))
    assert tuple(vec[k] for k in ks) == _brute_force_best(replicas, num_nodes, slots, ks)


def test_symmetry_reduced_enumeration_counts_multisets_of_nodes():
    # [2, 2] on 2 nodes x 2 slots: {00,11}, {01,01}
    assert sorted(enumerate_plans([2, 2], 2, 2)) == [((0, 0), (1, 1)), ((0, 1), (0, 1))]


@pytest.mark.parametrize("exact_plans", [20000, 0])
def test_optimal_never_below_baselines(exact_plans):
    rng = random.Random(4)
    checked = 0
    while checked < 25:
        n, c, e = rng.randint(2, 6), rng.randint(2, 4), rng.randint(2, 7)
        if n * c < e or (exact_plans and n * c > 16):
            continue
        r = _random_allocation(rng, n, c, e)
        target = rng.choice([None, rng.randint(1, n - 1)])
        result = optimal_plan(r, n, c, SearchConfig(target_failures=target, max_exact_plans=exact_plans))
        validate_plan(result.plan, r, c)
        ks = ([target] if target is not None else []) + [k for k in range(1, n) if k != target]
        key = tuple(recovery_vector(result.plan, e)[k] for k in ks)
        for baseline in (mro_plan, spread_plan, compact_plan):
            base = recovery_vector(baseline(r, n, c), e)
            assert key >= tuple(base[k] for k in ks)
            if target is not None:
                assert key[0] >= base[target]
        checked += 1


def test_large_instance_uses_closed_form():
    r = allocate_replicas([1 + (i * 37) % 11 for i in range(64)], num_nodes=256, slots_per_node=4, min_replicas=2)
    plan = mro_plan(r, 256, 4)
    est = recovery_probabilities(plan, 64, [2, 8])
    assert est[2].method == "closed_form" and 0 < est[8].probability < 1
    assert math.isclose(sum(r), 1024)
