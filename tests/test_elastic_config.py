"""``ElasticConfig``: flags -> replica map ``R[e, j]`` (standard layout, explicit counts, ``auto`` = eq. 1)."""

from __future__ import annotations

import pytest
import torch

from moe_ft.elastic.config import ElasticConfig, replica_map_from_plan
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
