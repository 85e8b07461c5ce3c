"""Greedy node mapping, transfer schedule and per-layer reconfiguration (Lazarus §4.3)."""

import random
from itertools import permutations

import pytest

from moe_ft.placement.layers import ExpertPlacementConfig, plan_layers, reconfigure
from moe_ft.placement.migration import map_nodes, num_fetches, transfer_schedule
from moe_ft.placement.search import SearchConfig


def test_mapping_recovers_a_relabelled_plan_without_fetches():
    plan = ((0, 1), (2, 3), (0, 2), (1, 3))
    held = {10: (2, 3), 11: (1, 3), 12: (0, 1), 13: (0, 2)}
    mapping = map_nodes(held, plan, 4)
    assert mapping == [12, 10, 13, 11]
    assert num_fetches(held, plan, mapping) == 0 and transfer_schedule(held, plan, mapping) == []


def test_greedy_mapping_close_to_optimal_on_small_instances():
    rng = random.Random(0)
    for _ in range(30):
        n, c, e = rng.randint(2, 5), rng.randint(1, 3), rng.randint(2, 5)
        plan = tuple(tuple(sorted(rng.randrange(e) for _ in range(c))) for _ in range(n))
        held = {100 + i: tuple(rng.randrange(e) for _ in range(c)) for i in range(n)}
        greedy = num_fetches(held, plan, map_nodes(held, plan, e))
        costs = [num_fetches(held, plan, list(p)) for p in permutations(sorted(held))]
        assert min(costs) <= greedy <= costs[0]  # costs[0]: the identity order of physical ids


def test_transfers_come_from_holders_and_spread_over_them():
    held = {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (), 4: (), 5: (), 6: ()}
    plan = ((0, 0), (0, 1), (0, 2), (0, 1), (0, 2), (0, 1), (0, 2))
    mapping = map_nodes(held, plan, 3)
    transfers = transfer_schedule(held, plan, mapping)
    assert len(transfers) == num_fetches(held, plan, mapping) == 8  # 4 new nodes x 2 experts
    for t in transfers:
        assert t.expert_idx in held[t.src] and t.expert_idx not in held[t.dst]
    sources_of_0 = [t.src for t in transfers if t.expert_idx == 0]
    counts = [sources_of_0.count(p) for p in (0, 1, 2)]
    assert max(counts) - min(counts) <= 1
    assert set(sources_of_0) == {0, 1, 2}  # every holder serves expert 0
    with pytest.raises(RuntimeError, match="no surviving replica"):
        transfer_schedule({0: (0,), 1: (0,)}, ((0,), (1,)), [0, 1])


def test_reconfigure_after_failure_and_join_reaches_the_new_plan():
    loads = [[40, 30, 20, 10], [5, 5, 50, 40]]
    config = ExpertPlacementConfig(slots_per_node=4, min_replicas=2, search=SearchConfig(max_exact_plans=2000))
    layers = plan_layers(loads, 5, config)
    current = [{100 + n: node for n, node in enumerate(layer.plan)} for layer in layers]
    for held in current:
        del held[102]  # node 102 fails
    nodes = [100, 101, 103, 104, 105]  # 105 joins
    result = reconfigure(current, loads, nodes, config)
    for held, layer in zip(current, result):
        state = {p: set(held.get(p, ())) for p in nodes}
        for t in layer.transfers:
            assert t.expert_idx in state[t.src]
        for t in layer.transfers:
            state[t.dst].add(t.expert_idx)
        for node, p in zip(layer.layer.plan, layer.physical):
            assert set(node) <= state[p]
        assert sorted(layer.physical) == nodes


def test_reconfigure_errors():
    config = ExpertPlacementConfig(slots_per_node=2)
    with pytest.raises(ValueError, match="layers"):
        reconfigure([{}], [[1, 2], [3, 4]], [0, 1], config)
    with pytest.raises(ValueError, match="unknown placement strategy"):
        ExpertPlacementConfig(slots_per_node=2, strategy="best")
