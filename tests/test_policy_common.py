"""Shared builders for the policy tests, plus tests of the base helpers and the factory."""

import random

import pytest
import torch

from moe_ft.policy import (
    DEFAULT_POLICY,
    DenseConfig,
    DensePolicy,
    PECPolicy,
    SparsePolicy,
    build_policy,
)
from moe_ft.policy.base import bytes_per_rank, make_plan, top_by_score, validate_operators
from moe_ft.popularity import ExpertPopularity, PopularityConfig
from moe_ft.state.operators import Level, OperatorId, OperatorInfo


def make_catalog(num_layers, num_experts, ep=1, pp=1, expert_full=300, expert_compute=100,
                 dense_full=600, dense_compute=200, rng=None):
    """A Megatron-like catalogue: layers split contiguously over ``pp`` stages, expert ``e`` on EP rank
    ``e // (num_experts / ep)``, non-experts attributed round-robin over the stage's EP ranks. With ``rng``
    expert sizes vary randomly (x1..x3)."""
    infos = []
    per_stage = -(-num_layers // pp)

    def size(full, compute):
        if rng is None:
            return full, compute
        f = rng.randint(1, 3)
        return full * f, compute * f

    for layer in range(num_layers):
        stage = layer // per_stage
        for e in range(num_experts):
            full, compute = size(expert_full, expert_compute)
            infos.append(OperatorInfo(op=OperatorId.expert_op(layer, e), bytes_full=full, bytes_compute=compute,
                                      ep_rank=e * ep // num_experts, pp_rank=stage))
        infos.append(OperatorInfo(op=OperatorId.dense(layer), bytes_full=dense_full, bytes_compute=dense_compute,
                                  ep_rank=layer % ep, pp_rank=stage))
        infos.append(OperatorInfo(op=OperatorId.gate(layer), bytes_full=30, bytes_compute=10,
                                  ep_rank=(layer + 1) % ep, pp_rank=stage))
    infos.append(OperatorInfo(op=OperatorId.embedding(), bytes_full=dense_full, bytes_compute=dense_compute))
    infos.append(OperatorInfo(op=OperatorId.output(), bytes_full=dense_full, bytes_compute=dense_compute,
                              ep_rank=ep - 1, pp_rank=pp - 1))
    return infos


def make_popularity(num_layers, num_experts):
    return ExpertPopularity(PopularityConfig(moe_layers=list(range(num_layers)), num_experts=num_experts))


def feed(pop, iteration, rng, skew=1.0, top_k=2, tokens=32):
    """One iteration of random routing: ``tokens * top_k`` assignments drawn with weights ``rank ** -skew``
    over a random permutation of the experts (so popularity is skewed and drifts)."""
    num_experts = pop.num_experts
    for layer in pop.moe_layers:
        perm = rng.sample(range(num_experts), num_experts)
        weights = [(perm[e] + 1) ** -skew for e in range(num_experts)]
        counts = [0] * num_experts
        for e in rng.choices(range(num_experts), weights=weights, k=tokens * top_k):
            counts[e] += 1
        pop.record(layer, torch.tensor(counts))
    pop.end_iteration(iteration)


# ------------------------------------------------------------------------------------------- tests
def test_validate_operators_rejects_duplicates_and_bad_sizes():
    op = OperatorInfo(op=OperatorId.dense(0), bytes_full=2, bytes_compute=1)
    with pytest.raises(ValueError, match="listed twice"):
        validate_operators([op, op])
    with pytest.raises(ValueError, match="bytes_compute <= bytes_full"):
        validate_operators([OperatorInfo(op=OperatorId.dense(0), bytes_full=1, bytes_compute=2)])
    with pytest.raises(ValueError, match="at least one operator"):
        validate_operators([])


def test_make_plan_is_explicit_sorted_and_read_only():
    ops = make_catalog(2, 2)
    plan = make_plan(ops, {OperatorId.gate(1): Level.FULL})
    assert list(plan) == sorted(i.op for i in ops)
    assert plan[OperatorId.gate(1)] == Level.FULL and plan[OperatorId.dense(0)] == Level.NONE
    with pytest.raises(TypeError):
        plan[OperatorId.dense(0)] = Level.FULL  # type: ignore[index]
    info = {i.op: i for i in ops}
    assert bytes_per_rank(plan, info) == {(0, 0): 30}


def test_top_by_score_breaks_ties_by_operator_id():
    ops = [OperatorInfo(op=OperatorId.expert_op(0, e), bytes_full=1, bytes_compute=1) for e in range(4)]
    scores = {ops[0].op: 1.0, ops[1].op: 5.0, ops[2].op: 5.0, ops[3].op: 1.0}
    assert [i.op.expert for i in top_by_score(ops, scores, 3)] == [1, 2, 0]


def test_build_policy_from_dataclass_mapping_or_defaults():
    ops = make_catalog(2, 4)
    assert isinstance(build_policy("dense", None, ops), DensePolicy)
    assert build_policy("dense", DenseConfig(interval=3), ops).config.interval == 3
    pec = build_policy("pec", {"k_snapshot": 2, "selection": "load_aware"}, ops)
    assert isinstance(pec, PECPolicy) and pec.k == 2
    assert isinstance(build_policy(DEFAULT_POLICY, {"window": 3}, ops), SparsePolicy)
    with pytest.raises(ValueError, match="unknown snapshot policy"):
        build_policy("moc", None, ops)
    with pytest.raises(ValueError, match="no field"):
        build_policy("pec", {"k": 2}, ops)
    with pytest.raises(ValueError, match="takes a PECConfig"):
        build_policy("pec", DenseConfig(), ops)
    with pytest.raises(ValueError, match="needs bandwidth"):
        build_policy("sparse", None, ops)


def test_state_dict_of_another_policy_is_rejected():
    ops = make_catalog(1, 2)
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_policy("pec", None, ops).load_state_dict(build_policy("dense", None, ops).state_dict())


def test_dense_policy_full_every_interval():
    ops = make_catalog(2, 3)
    policy = DensePolicy(DenseConfig(interval=4, offset=1), ops)
    for t in range(20):
        levels = set(policy.plan(t).values())
        assert levels == ({Level.FULL} if t % 4 == 1 else {Level.NONE})
    with pytest.raises(ValueError, match="offset"):
        DenseConfig(interval=2, offset=2)


def test_identical_inputs_give_identical_plans_for_every_policy():
    rng = random.Random(0)
    for name, cfg in [("dense", {"interval": 2}), ("pec", {"k_snapshot": 2, "selection": "load_aware"}),
                      ("selective", {"local_budget": 4000, "remote_budget": 2500}), ("sparse", {"window": 4})]:
        ops = make_catalog(3, 6, ep=2, rng=random.Random(1))
        a, b = build_policy(name, cfg, ops), build_policy(name, cfg, list(reversed(ops)))
        pa, pb = make_popularity(3, 6), make_popularity(3, 6)
        for t in range(12):
            seed = rng.randrange(1000)
            feed(pa, t, random.Random(seed))
            feed(pb, t, random.Random(seed))
            plan_a, plan_b = a.plan(t, pa), b.plan(t, pb)
            assert dict(plan_a) == dict(plan_b)
            for pop, plan in ((pa, plan_a), (pb, plan_b)):
                pop.mark_full(t, [op for op, lvl in plan.items() if lvl == Level.FULL])
