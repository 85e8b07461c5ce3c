"""Rebalancing inside a run (``moe_ft/elastic/rebalance.py``, Lazarus §4.3/§5): plan -> moves, and a live
two-rank swap over gloo that keeps every moved expert's weights, fp32 master and Adam moments bitwise."""

from __future__ import annotations

import pytest

from moe_ft.elastic.rebalance import held_from_replicas, plan_rebalance
from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.layers import ExpertPlacementConfig

# 2 EP ranks x 3 slots, 4 experts: rank 0 holds {0, 1, 2}, rank 1 holds {0, 1, 3}
CURRENT = {0: [[1, 1], [1, 1], [1, 0], [0, 1]]}
CONFIG = ExpertPlacementConfig(slots_per_node=3, min_replicas=1)


def test_held_from_replicas():
    assert held_from_replicas(CURRENT) == {0: {0: {0, 1, 2}, 1: {0, 1, 3}}}


def test_skewed_loads_move_only_what_the_new_plan_needs():
    loads = {0: [100.0, 1.0, 1.0, 1.0]}  # expert 0 hot: eq. 1 gives it 3 of the 6 slots
    plan = plan_rebalance(CURRENT, loads, config=CONFIG)
    counts = plan.replica_counts()[0]
    assert counts == allocate_replicas(loads[0], num_nodes=2, slots_per_node=3, min_replicas=1) == [3, 1, 1, 1]
    assert plan.changed
    for j in (0, 1):  # a rank fetches exactly what it gains, from a rank that holds it now
        gained = {(f.layer, f.expert_idx) for f in plan.fetches if f.dst == j}
        assert gained == plan.gains(j)
    for f in plan.fetches:
        assert plan.old[f.layer][f.expert_idx][f.src] > 0 and f.src != f.dst
    assert len(plan.fetches) == 1  # one rank gives expert 0 all its slots, the other takes over expert 2


def test_unchanged_loads_move_nothing():
    loads = {0: [2.0, 2.0, 1.0, 1.0]}  # eq. 1 gives the current counts [2, 2, 1, 1]
    plan = plan_rebalance(CURRENT, loads, config=CONFIG)
    assert plan.replica_counts()[0] == [2, 2, 1, 1]
    assert plan.fetches == [] and not plan.changed


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="layers of the current plans"):
        plan_rebalance(CURRENT, {1: [1.0] * 4}, config=CONFIG)
    with pytest.raises(ValueError, match="4 experts"):
        plan_rebalance(CURRENT, {0: [1.0] * 3}, config=CONFIG)
    with pytest.raises(ValueError, match="slots"):
        plan_rebalance({0: [[2, 1], [1, 1], [1, 0], [0, 1]]}, {0: [1.0] * 4}, config=CONFIG)
    with pytest.raises(ValueError, match="without a replica"):
        plan_rebalance({0: [[2, 1], [0, 0], [1, 1], [0, 1]]}, {0: [1.0] * 4}, config=CONFIG)


def test_random_drifts_on_four_ranks_fetch_exactly_the_gains():
    import random

    rng = random.Random(15)
    config = ExpertPlacementConfig(slots_per_node=3, min_replicas=1)
    # 6 experts in 4 EP ranks x 3 slots
    start = [[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]]
    replicas = {0: start, 1: start}
    for _ in range(5):  # successive rebalances as loads drift
        loads = {layer: [rng.choice([1.0, 5.0, 50.0]) for _ in range(6)] for layer in (0, 1)}
        plan = plan_rebalance(replicas, loads, config=config)
        for layer, rows in plan.new.items():
            assert all(sum(row) >= 1 for row in rows), "every expert present after the rebalance"
            assert [sum(col) for col in zip(*rows)] == [3] * 4, "every slot filled"
            assert [sum(row) for row in rows] == allocate_replicas(loads[layer], num_nodes=4, slots_per_node=3,
                                                                   min_replicas=1)
        for j in range(4):
            assert {(f.layer, f.expert_idx) for f in plan.fetches if f.dst == j} == plan.gains(j)
        assert all(plan.old[f.layer][f.expert_idx][f.src] > 0 for f in plan.fetches)
        assert plan_rebalance(replicas, loads, config=config) == plan, "deterministic"
        replicas = plan.new
