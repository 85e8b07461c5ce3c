import random

import pytest
import torch
from test_policy_common import feed, make_catalog, make_popularity

from moe_ft.policy import SelectiveConfig, SelectivePolicy
from moe_ft.policy.base import rank_key
from moe_ft.policy.selective import allocate_proportional
from moe_ft.state.operators import Level, OperatorId


def _full_experts(plan):
    return {op for op, lvl in plan.items() if op.is_expert and lvl == Level.FULL}


def test_allocate_proportional_sums_caps_and_follows_risk():
    assert allocate_proportional(10, [1, 1, 2], [10, 10, 10]) == [3, 2, 5]  # 2.5, 2.5, 5: tie -> lower index
    assert allocate_proportional(6, [0, 0, 0], [5, 5, 5]) == [2, 2, 2]
    assert allocate_proportional(9, [100, 1, 1], [4, 4, 4]) == [4, 3, 2]  # capped layer spills over
    assert allocate_proportional(50, [1, 2], [3, 4]) == [3, 4]
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        risks = [rng.choice([0, rng.random() * 100]) for _ in range(n)]
        caps = [rng.randint(0, 8) for _ in range(n)]
        total = rng.randint(0, 40)
        alloc = allocate_proportional(total, risks, caps)
        assert sum(alloc) == min(total, sum(caps))
        assert all(0 <= a <= c for a, c in zip(alloc, caps))
        if sum(risks) > 0 and total <= sum(caps):
            for a, r, c in zip(alloc, risks, caps):  # never below the floor of its share (unless capped)
                assert a >= min(int(r / sum(risks) * total), c)


def test_never_exceeds_either_budget_and_spends_it_greedily():
    rng = random.Random(1)
    for case in range(40):
        layers, experts = rng.randint(1, 4), rng.choice([2, 4, 8])
        ep, pp = rng.choice([1, 2]), rng.randint(1, 2)
        ops = make_catalog(layers, experts, ep=ep, pp=pp, rng=rng)
        non_expert = {}
        for i in ops:
            non_expert[rank_key(i)] = non_expert.get(rank_key(i), 0) + (0 if i.op.is_expert else i.bytes_full)
        floor = max(non_expert.values())
        # the local budget buys at least one expert of every rank (the policy refuses less: no expert saved)
        local = max(n + max((i.bytes_full for i in ops if i.op.is_expert and rank_key(i) == key), default=0)
                    for key, n in non_expert.items()) + rng.randint(0, 6000)
        remote = floor + rng.randint(0, local - floor)
        policy = SelectivePolicy(SelectiveConfig(local_budget=local, remote_budget=remote), ops)
        pop = make_popularity(layers, experts)
        for t in range(8):
            feed(pop, t, rng, skew=rng.choice([0.0, 2.0]))
            plan = policy.plan(t, pop)
            remote_plan = policy.remote_plan(t, plan, pop)
            assert max(policy.plan_bytes(plan).values()) <= local, case
            assert max(policy.plan_bytes(remote_plan).values()) <= remote, case
            full = _full_experts(plan)
            assert _full_experts(remote_plan) <= full
            assert all(plan[i.op] == Level.FULL for i in ops if not i.op.is_expert)
            for key in non_expert:  # S_total = (B - non-expert bytes) // C_expert experts, all spent
                mine = [i for i in ops if i.op.is_expert and rank_key(i) == key]
                if mine:
                    cost = max(i.bytes_full for i in mine)
                    chosen = sum(i.op in full for i in mine)
                    assert chosen == min((local - non_expert[key]) // cost, len(mine)), (case, key)
            pop.mark_full(t, full)


def test_layers_share_by_token_risk_and_top_experts_by_tokens_since_full():
    ops = make_catalog(2, 4, dense_full=100, dense_compute=10, expert_full=100, expert_compute=10)
    non_expert = sum(i.bytes_full for i in ops if not i.op.is_expert)
    pop = make_popularity(2, 4)
    e = OperatorId.expert_op
    pop.mark_full(0, [e(l, x) for l in range(2) for x in range(4)])  # a first snapshot saved every expert
    pop.record(0, torch.tensor([30, 0, 50, 10]))  # layer risk 90
    pop.record(1, torch.tensor([5, 3, 1, 1]))  # layer risk 10
    pop.end_iteration(1)
    policy = SelectivePolicy(SelectiveConfig(local_budget=non_expert + 4 * 100, remote_budget=non_expert + 100), ops)
    plan = policy.plan(1, pop)
    # S_total = 4: floor(0.9*4)=3, floor(0.1*4)=0, remainder (0.6 vs 0.4) -> layer 0 gets 4? cap 4 -> [4, 0]
    assert _full_experts(plan) == {e(0, 0), e(0, 1), e(0, 2), e(0, 3)}
    remote = policy.remote_plan(1, plan, pop)
    assert _full_experts(remote) == {e(0, 2)}  # S_total = 1: the riskiest expert
    pop.mark_full(1, _full_experts(plan))
    assert _full_experts(policy.plan(2, pop)) == {e(1, 0), e(1, 1), e(1, 2), e(1, 3)}


def test_experts_never_saved_go_first_so_that_a_point_becomes_recoverable():
    """Experts without a FULL entry are saved before any chosen by token risk, the riskiest first: with one
    routed no tokens, ranking by tokens alone (MoEtion §4.3) never saves it, and no point is recoverable."""
    ops = make_catalog(1, 4, dense_full=100, dense_compute=10, expert_full=100, expert_compute=10)
    non_expert = sum(i.bytes_full for i in ops if not i.op.is_expert)
    e = OperatorId.expert_op
    policy = SelectivePolicy(SelectiveConfig(local_budget=non_expert + 2 * 100, remote_budget=non_expert + 100), ops)
    routed = torch.tensor([40, 20, 10, 0])  # expert 3 is routed nothing, ever
    pop, saved = make_popularity(1, 4), []
    for t in range(8):
        pop.record(0, routed)
        pop.end_iteration(t)
        saved.append(_full_experts(policy.plan(t, pop)))
        pop.mark_full(t, saved[-1])
    assert saved[:2] == [{e(0, 0), e(0, 1)}, {e(0, 2), e(0, 3)}]  # never saved: all first, the riskiest first
    assert all(e(0, 3) not in s for s in saved[2:])  # then by tokens: expert 3 has none
    # once saved, the paper's ranking decides: an expert saved once and routed nothing since is never saved
    # again (and before, with the ranking alone, it was never saved at all)
    pop = make_popularity(1, 4)
    pop.mark_full(0, [e(0, 3)])
    for t in range(8):
        pop.record(0, routed)
        pop.end_iteration(t)
        plan = _full_experts(policy.plan(t, pop))
        assert e(0, 3) not in plan
        pop.mark_full(t, plan)


def test_budget_below_non_expert_state_is_an_actionable_error():
    ops = make_catalog(2, 2)
    with pytest.raises(ValueError, match="local_budget .* non-expert"):
        SelectivePolicy(SelectiveConfig(local_budget=10, remote_budget=10), ops)
    non_expert = sum(i.bytes_full for i in ops if not i.op.is_expert)
    with pytest.raises(ValueError, match="buys no expert .* no point would be recoverable; raise the budget"):
        SelectivePolicy(SelectiveConfig(local_budget=non_expert + 299, remote_budget=10**6), ops)  # experts: 300 B
    with pytest.raises(ValueError, match="remote_includes_non_expert=False"):
        SelectivePolicy(SelectiveConfig(local_budget=10**6, remote_budget=10), ops)
    policy = SelectivePolicy(SelectiveConfig(local_budget=10**6, remote_budget=300,
                                             remote_includes_non_expert=False), ops)
    with pytest.raises(ValueError, match="pass the ExpertPopularity"):
        policy.plan(0)
    pop = make_popularity(2, 2)
    plan = policy.plan(0, pop)
    remote = policy.remote_plan(0, plan, pop)
    assert len(_full_experts(remote)) == 1 and set(remote.values()) == {Level.FULL, Level.NONE}
    assert all(remote[op] == Level.NONE for op in remote if not op.is_expert)


def test_a_budget_derived_from_a_bandwidth_is_floored_at_build_as_when_measured():
    """``B = BW x T_iter`` with the estimate of ``T_iter`` the policy is built with is raised to the least budget
    (non-expert state and one expert) as every measured ``T_iter`` raises it; it was refused at build, so a run
    whose first estimate was short stopped where the next measurement would have been floored."""
    ops = make_catalog(2, 2)
    non_expert = sum(i.bytes_full for i in ops if not i.op.is_expert)
    tiny = SelectiveConfig(local_budget=10, remote_budget=10, local_bandwidth=10.0, remote_bandwidth=10.0)
    policy = SelectivePolicy(tiny, ops)
    assert policy.config.local_budget == non_expert + 300 == policy.config.remote_budget  # experts: 300 B
    policy.observe_iteration_time(1.0)
    assert policy.config.local_budget == non_expert + 300


def test_from_bandwidth_multiplies_bandwidth_by_iteration_time():
    cfg = SelectiveConfig.from_bandwidth(host_bytes_per_s=50e9, net_bytes_per_s=12.5e9, t_iter_s=2.0)
    assert (cfg.local_budget, cfg.remote_budget) == (100_000_000_000, 25_000_000_000)
    with pytest.raises(ValueError, match="positive"):
        SelectiveConfig.from_bandwidth(host_bytes_per_s=0, net_bytes_per_s=1, t_iter_s=1)
