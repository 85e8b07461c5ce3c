"""The pieces of an in-run rebalance (Lazarus §4.3) that need no process group.

* the canonical MLP layout (a rebuilt model holds every expert where the live one does: exactness);
* the policies' dense point (``start_dense``): the snapshot of the rebalance iteration holds every operator
  FULL and is a window by itself; the window it interrupts is never a recovery point; the next window has
  the configured length; retention recognises the dense window;
* flag validation;
* the fault threshold the rebalance plans with (the world's, as the restart that built it).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_policy_common import make_catalog, make_popularity

from moe_ft.elastic.config import ElasticConfig
from moe_ft.elastic.live import canonical_mlps
from moe_ft.elastic.rebalance import plan_rebalance
from moe_ft.elastic.rebalance_component import LiveRebalance
from moe_ft.policy import DenseConfig, DensePolicy, SparseConfig, SparsePolicy
from moe_ft.policy.sparse import without_abandoned
from moe_ft.state.operators import Level


def test_canonical_layout_is_that_of_a_fresh_build():
    assert canonical_mlps([3, 0, 2], 4) == {0: 0, 2: 1, 3: 2}
    with pytest.raises(ValueError, match="do not fit in 2 MLPs"):
        canonical_mlps([0, 1, 2], 2)


def test_sparse_dense_point_interrupts_the_window_and_the_next_has_the_configured_length():
    ops = make_catalog(2, 4, ep=2)
    policy, pop = SparsePolicy(SparseConfig(window=3), ops), make_popularity(2, 4)
    for t in range(5):  # windows [0, 2], [3, 5]; 5 not planned yet
        policy.plan(t, pop)
    assert (policy.current.start, policy.current.length) == (3, 3)
    policy.start_dense(5)  # rebalanced after iteration 5: the window [3, 5] ... would end at 5
    dense = policy.plan(5, pop)
    assert set(dense.values()) == {Level.FULL} and set(dense) == {i.op for i in ops}
    nxt = policy.plan(6, pop)
    assert (policy.current.start, policy.current.length) == (6, 3)
    assert (policy.previous.start, policy.previous.length) == (5, 1)
    assert Level.FULL in nxt.values() and Level.COMPUTE in nxt.values()
    assert policy.state_dict()["previous"]["length"] == 1  # recorded with the snapshots: a recovery window

    # interrupted inside a window: [3, 5] was open at 4, the dense window starts at 4 -> [3, 5] is abandoned
    other = SparsePolicy(SparseConfig(window=3), ops)
    for t in range(4):
        other.plan(t, pop)
    other.start_dense(4)
    assert other.previous is None, "the interrupted window must not be remembered as a recovery window"
    assert without_abandoned({(0, 2), (3, 5), (4, 4), (5, 7)}) == [(0, 2), (4, 4), (5, 7)]
    assert without_abandoned({(0, 2), (3, 5), (6, 8)}) == [(0, 2), (3, 5), (6, 8)]


def test_sparse_retention_follows_the_remembered_windows():
    ops = make_catalog(1, 2, ep=1)
    policy, pop = SparsePolicy(SparseConfig(window=3), ops), make_popularity(1, 2)
    for t in range(6):
        policy.plan(t, pop)
    rule = policy.retention_rule([i.op for i in ops])
    assert rule.window_of(5) == (3, 5) and rule.window_of(2) == (0, 2) and rule.window_of(4) is None
    policy.start_dense(6)
    policy.plan(6, pop)
    assert rule.window_of(6) == (6, 6), "the rule reads the policy's state when the store collects"
    policy.plan(7, pop)
    assert rule.window_of(6) == (6, 6) and rule.window_of(9) == (7, 9)
    assert rule.window_of(7) is None, "no window ends inside the open one"


def test_dense_policy_forces_a_full_point_off_its_interval():
    ops = make_catalog(1, 2)
    policy = DensePolicy(DenseConfig(interval=4), ops)
    assert set(policy.plan(5).values()) == {Level.NONE}
    policy.start_dense(5)
    assert set(policy.plan(5).values()) == {Level.FULL}
    assert set(policy.plan(6).values()) == {Level.NONE} and set(policy.plan(8).values()) == {Level.FULL}


def test_rebalance_flags_are_checked():
    with pytest.raises(ValueError, match="add --ft-elastic"):
        ElasticConfig(ft_rebalance_interval=4)
    with pytest.raises(ValueError, match=">= 0"):
        ElasticConfig(ft_rebalance_interval=-1, ft_elastic=True)
    assert ElasticConfig(ft_rebalance_interval=4, ft_elastic=True).ft_rebalance_interval == 4


@pytest.mark.parametrize("policy, recompute", [("pec", False), ("selective", True)])
def test_rebalance_refuses_policies_without_a_dense_point(policy, recompute):
    """Lossy policies (and so --ft-optimizer-recompute, which needs selective) cannot follow a rebalance."""
    from types import SimpleNamespace

    from moe_ft.config import FTConfig
    from moe_ft.replication.config import ReplicationConfig
    from moe_ft.snapshot.config import SnapshotConfig

    ft = FTConfig(ft=True, snapshot=SnapshotConfig(policy=policy),
                  replication=ReplicationConfig(replicas=1 if recompute else 0, optimizer_recompute=recompute))
    args = SimpleNamespace(extra={"FTConfig": ft},
                           model=SimpleNamespace(moe_token_dispatcher_type="flexible", num_layers=2, num_experts=4,
                                                 moe_expert_capacity_factor=None, moe_grouped_gemm=False),
                           parallel=SimpleNamespace(pipeline_model_parallel_size=1, use_distributed_optimizer=False,
                                                    num_layers_per_virtual_pipeline_stage=None,
                                                    virtual_pipeline_model_parallel_size=None,
                                                    tensor_model_parallel_size=1, expert_tensor_parallel_size=None,
                                                    expert_model_parallel_size=1))
    cfg = ElasticConfig(ft_elastic=True, ft_rebalance_interval=4, ft_expert_replicas=["1", "1", "1", "1"])
    with pytest.raises(ValueError, match=f"--ft-policy {policy} cannot take"):
        cfg.check_args(args)


def _rebalance_on(plan: list[list[int]], fault_threshold: int) -> LiveRebalance:
    """A ``LiveRebalance`` over one elastic MoE layer serving ``plan`` (``R[e][j]``); nothing else is used."""
    layer = SimpleNamespace(layer_number=1, mlp=SimpleNamespace(replicas=torch.tensor(plan)))
    model = [SimpleNamespace(decoder=SimpleNamespace(layers=[layer]))]
    elastic = ElasticConfig(ft_elastic=True, ft_rebalance_interval=4, ft_fault_threshold=fault_threshold)
    return LiveRebalance(elastic, SimpleNamespace(state=SimpleNamespace(model=model)), recorder=None)


def test_rebalance_after_a_shrink_plans_with_the_fault_threshold_the_world_holds():
    """Launched on 4 EP ranks x 2 slots with f = 2, shrunk to 2 EP ranks: 4 slots give 4 experts one copy
    each, so the restart re-planned with f = 1; the rebalance must too (eq. 1 with f = 2 raised and stopped
    the run at the first rebalance), and plan with the flag's f again once the world holds it."""
    shrunk = [[1, 0], [1, 0], [0, 1], [0, 1]]
    live = _rebalance_on(shrunk, fault_threshold=2)
    assert live.placement.min_replicas == 1 and live.placement.slots_per_node == 2
    out = plan_rebalance({0: shrunk}, {0: [5.0, 50.0, 30.0, 40.0]}, config=live.placement)
    assert [sum(row) for row in out.new[0]] == [1, 1, 1, 1]
    grown = [[1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1]]
    assert _rebalance_on(grown, fault_threshold=2).placement.min_replicas == 2
