"""``ElasticConfig``: flags -> replica map ``R[e, j]`` (standard layout, explicit counts, ``auto`` = eq. 1)."""

from __future__ import annotations

import pytest
import torch

from moe_ft.elastic.config import ElasticConfig, replica_map_from_plan
from moe_ft.elastic.inventory import LayoutRecord
from moe_ft.elastic.restart import RestartDecision
from moe_ft.placement.allocation import allocate_replicas

pytestmark = pytest.mark.timeout(30)


def test_default_is_standard_expert_parallel_layout():
    r = ElasticConfig().replica_map(4, 2)
    assert torch.equal(r, torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]))


@pytest.mark.parametrize("strategy", ["optimal", "mro", "spread", "compact"])
def test_explicit_counts_fill_every_slot(strategy):
    cfg = ElasticConfig(ft_expert_replicas=["3", "1", "2", "2"], ft_expert_slots=4, ft_placement=strategy)
    r = cfg.replica_map(4, 2)
    assert r.sum(1).tolist() == [3, 1, 2, 2] and r.sum(0).tolist() == [4, 4]


def test_auto_uses_eq1_allocation_and_fault_threshold():
    cfg = ElasticConfig(ft_expert_replicas=["auto"], ft_expert_slots=3, ft_fault_threshold=2,
                        ft_expert_loads=[8.0, 1.0, 1.0, 1.0])
    r = cfg.replica_map(4, 4)
    assert r.sum(1).tolist() == allocate_replicas([8, 1, 1, 1], num_nodes=4, slots_per_node=3, min_replicas=2)
    assert ((r > 0).sum(1) >= 2).all(), "f=2: every expert on at least two EP ranks"


@pytest.mark.parametrize("kwargs, num_experts, ep, match", [
    ({"ft_expert_replicas": ["2", "x"]}, 2, 2, "one integer per expert"),
    ({"ft_expert_replicas": ["3", "1"], "ft_expert_slots": 1}, 2, 2, "slots"),
    ({"ft_expert_replicas": ["1", "1", "1"]}, 2, 2, "counts for 2 experts"),
    ({"ft_expert_replicas": ["auto"], "ft_expert_slots": 1, "ft_fault_threshold": 2}, 4, 2, "cannot hold"),
    ({"ft_expert_loads": [1.0, 2.0]}, 2, 2, "only used with"),
])
def test_errors_are_actionable(kwargs, num_experts, ep, match):
    with pytest.raises(ValueError, match=match):
        ElasticConfig(**kwargs).replica_map(num_experts, ep)


def test_replica_map_from_plan_counts_stacked_slots():
    assert torch.equal(replica_map_from_plan(((0, 0), (0, 1)), 2), torch.tensor([[2, 1], [0, 1]]))


@pytest.mark.parametrize("replicas, slots", [(["7", "3", "3", "3"], 4), (["auto"], 2)])
def test_the_fallback_plan_keeps_the_fault_threshold_the_world_holds(replicas, slots):
    """A fallback start after a shrink from 4 to 2 EP ranks, ``--ft-fault-threshold 2``, 4 experts. Counts
    for the launched world (4 x 4 slots): eq. 1 re-allocates the 8 slots of this one with f = 2 (it used
    f = 1: experts 1-3 on one rank each). ``auto`` with 2 slots: 4 slots hold one copy each, f lowered to 1
    as ``adjust_parallel`` announced (eq. 1 with f = 2 raised and the start died)."""
    previous = LayoutRecord(generation=0, world_size=4, ep_size=4, iteration=9, plans={0: []},
                            loads={0: [100.0, 1.0, 1.0, 1.0]})
    cfg = ElasticConfig(ft_expert_replicas=replicas, ft_expert_slots=slots, ft_fault_threshold=2, ft_elastic=True)
    cfg.restart = RestartDecision("fallback", 1, previous, world_size=2, ep_size=2)
    r = cfg.replica_map(4, 2, 0)
    assert r.sum(0).tolist() == [slots, slots]
    holders = (r > 0).sum(1).tolist()
    assert holders == ([2, 2, 2, 2] if slots == 4 else [1, 1, 1, 1]), r.tolist()
