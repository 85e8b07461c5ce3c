import math
import random

import pytest
import torch
from test_policy_common import feed, make_catalog, make_popularity

from moe_ft.policy import PECConfig, PECPolicy
from moe_ft.policy.pec import interleaved_order
from moe_ft.state.operators import Level, OperatorId


def _full_experts(plan):
    return [op for op, lvl in plan.items() if op.is_expert and lvl == Level.FULL]


def test_never_exceeds_k_and_non_experts_always_full():
    rng = random.Random(0)
    for _ in range(30):
        layers, experts = rng.randint(1, 4), rng.choice([2, 4, 8])
        ops = make_catalog(layers, experts, ep=rng.choice([1, 2]), pp=rng.randint(1, 2))
        k = rng.randint(1, experts + 2)
        cfg = PECConfig(k_snapshot=k, k_persist=1, selection=rng.choice(["sequential", "load_aware"]),
                        interval=rng.randint(1, 3))
        policy, pop = PECPolicy(cfg, ops), make_popularity(layers, experts)
        for t in range(20):
            feed(pop, t, rng)
            plan = policy.plan(t, pop)
            full = _full_experts(plan)
            if t % cfg.interval:
                assert set(plan.values()) == {Level.NONE}
                continue
            assert all(plan[i.op] == Level.FULL for i in ops if not i.op.is_expert)
            assert all(lvl in (Level.FULL, Level.NONE) for lvl in plan.values())
            for layer in range(layers):
                assert sum(op.layer == layer for op in full) == min(k, experts)
            pop.mark_full(t, full)


def test_sequential_covers_every_expert_each_sweep():
    rng = random.Random(1)
    for _ in range(20):
        layers, experts = rng.randint(1, 3), rng.choice([3, 4, 6, 8])
        k = rng.randint(1, experts)
        policy = PECPolicy(PECConfig(k_snapshot=k, k_persist=1), make_catalog(layers, experts, ep=1))
        sweep = math.ceil(experts / k)
        for first in range(0, 3 * sweep, sweep):
            seen = set()
            for t in range(first, first + sweep):
                seen.update(_full_experts(policy.plan(t)))
            assert len(seen) == layers * experts


def test_sequential_balances_ep_ranks_within_one_expert():
    """Bound: with uniform expert sizes and R | N, the FULL expert counts of any two EP ranks of a pipeline
    stage differ by at most one at every checkpoint, so their expert bytes differ by <= one expert."""
    rng = random.Random(2)
    for _ in range(40):
        ep = rng.choice([2, 4])
        experts = ep * rng.randint(1, 4)
        layers, pp = rng.randint(1, 6), rng.randint(1, 2)
        ops = make_catalog(layers, experts, ep=ep, pp=pp)
        info = {i.op: i for i in ops}
        policy = PECPolicy(PECConfig(k_snapshot=rng.randint(1, experts), k_persist=1), ops)
        for t in range(2 * experts):
            counts = {(s, r): 0 for s in range(pp) for r in range(ep) if any(i.pp_rank == s for i in ops)}
            for op in _full_experts(policy.plan(t)):
                counts[(info[op].pp_rank, info[op].ep_rank)] += 1
            for stage in range(pp):
                per_rank = [c for (s, _), c in counts.items() if s == stage]
                if per_rank:
                    assert max(per_rank) - min(per_rank) <= 1, (t, counts)


def test_interleaved_order_alternates_ranks():
    ops = [i for i in make_catalog(1, 8, ep=4) if i.op.is_expert]
    assert [i.op.expert for i in interleaved_order(ops)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_load_aware_picks_most_unsaved_tokens():
    ops = make_catalog(2, 4)
    pop = make_popularity(2, 4)
    pop.record(0, torch.tensor([1, 9, 9, 3]))
    pop.record(1, torch.tensor([4, 0, 2, 8]))
    pop.end_iteration(0)
    policy = PECPolicy(PECConfig(k_snapshot=2, k_persist=1, selection="load_aware"), ops)
    e = OperatorId.expert_op
    assert sorted(_full_experts(policy.plan(0, pop))) == [e(0, 1), e(0, 2), e(1, 0), e(1, 3)]
    pop.mark_full(0, [e(0, 1), e(0, 2), e(1, 0), e(1, 3)])
    # experts never saved go first, the riskiest first: e(1, 1), routed no token, as well (by tokens alone
    # e(1, 0), just saved, would tie with it at 0 and win on OperatorId order, and e(1, 1) would never be saved)
    assert sorted(_full_experts(policy.plan(0, pop))) == [e(0, 0), e(0, 3), e(1, 1), e(1, 2)]


def test_load_aware_saves_an_expert_routed_no_token_so_that_a_point_becomes_recoverable():
    ops = make_catalog(1, 4)
    policy = PECPolicy(PECConfig(k_snapshot=1, k_persist=1, selection="load_aware", dynamic_k=False), ops)
    pop, saved = make_popularity(1, 4), set()
    e = OperatorId.expert_op
    for t in range(6):
        pop.record(0, torch.tensor([9, 5, 2, 0]))  # expert 3: no token, ever
        pop.end_iteration(t)
        plan = _full_experts(policy.plan(t, pop))
        saved |= set(plan)
        pop.mark_full(t, plan)
    assert saved == {e(0, 0), e(0, 1), e(0, 2), e(0, 3)}  # every expert has a FULL entry after N/K checkpoints


def test_dynamic_k_doubles_after_accumulated_plt_crosses_threshold():
    ops = make_catalog(2, 8)
    policy = PECPolicy(PECConfig(k_snapshot=1, k_persist=1), ops)
    before = {t: dict(policy.plan(t)) for t in range(12)}
    assert policy.on_recovery(5, 0.02) == 1  # accumulated 2 % <= 3.75 %
    assert policy.on_recovery(5, 0.02) == 2  # 4 % > 3.75 %: K doubles, accumulator restarts
    assert policy.accumulated_plt == 0.0
    for t in range(6):
        assert dict(policy.plan(t)) == before[t]  # the past is unchanged (replays see the old K)
    for t in range(6, 12):
        assert len(_full_experts(policy.plan(t))) == 2 * 2
    # the rotation continues where K=1 left it: the two experts after the last ones saved
    last = {op.expert for op in _full_experts(before[5]) if op.layer == 0}
    nxt = {op.expert for op in _full_experts(policy.plan(6)) if op.layer == 0}
    order = [i.op.expert for i in interleaved_order([i for i in ops if i.op.is_expert and i.op.layer == 0])]
    pos = order.index(last.pop())
    assert nxt == {order[(pos + 1) % 8], order[(pos + 2) % 8]}
    for _ in range(5):
        policy.on_recovery(20, 0.5)
    assert policy.k == 8 and len(_full_experts(policy.plan(30))) == 16
    fixed = PECPolicy(PECConfig(k_snapshot=1, k_persist=1, dynamic_k=False), ops)
    assert fixed.on_recovery(3, 0.5) == 1


def test_persist_plan_takes_k_persist_of_the_snapshot_and_reaches_every_expert():
    rng = random.Random(3)
    for _ in range(15):
        layers, experts = rng.randint(1, 3), rng.choice([4, 6, 8])
        k = rng.randint(1, experts)
        kp = rng.randint(1, k)
        policy = PECPolicy(PECConfig(k_snapshot=k, k_persist=kp, selection=rng.choice(["sequential", "load_aware"])),
                           make_catalog(layers, experts))
        pop = make_popularity(layers, experts)
        persisted = set()
        for t in range(experts * experts):
            feed(pop, t, rng, skew=2.0)
            snap = policy.plan(t, pop)
            persist = policy.persist_plan(t, snap)
            assert dict(policy.persist_plan(t, snap)) == dict(persist)  # idempotent per iteration
            full_snap, full_persist = set(_full_experts(snap)), set(_full_experts(persist))
            assert full_persist <= full_snap
            for layer in range(layers):
                assert sum(op.layer == layer for op in full_persist) == kp
            assert all(persist[op] == Level.FULL for op in persist if not op.is_expert)
            persisted |= full_persist
            pop.mark_full(t, full_snap)
        if policy.config.selection == "sequential":
            assert len(persisted) == layers * experts


def test_state_dict_round_trip_continues_the_same_schedule():
    rng = random.Random(4)
    ops = make_catalog(3, 8, ep=2)
    for selection in ("sequential", "load_aware"):
        a, pop_a = PECPolicy(PECConfig(k_snapshot=2, k_persist=1, selection=selection), ops), make_popularity(3, 8)
        for t in range(7):
            feed(pop_a, t, rng)
            a.persist_plan(t, a.plan(t, pop_a))
        a.on_recovery(6, 0.05)
        b, pop_b = PECPolicy(PECConfig(k_snapshot=2, k_persist=1, selection=selection), ops), make_popularity(3, 8)
        b.load_state_dict(a.state_dict())
        pop_b.load_state_dict(pop_a.state_dict())
        assert b.k == 4
        for t in range(7, 20):
            seed = rng.randrange(10**6)
            feed(pop_a, t, random.Random(seed))
            feed(pop_b, t, random.Random(seed))
            pa, pb = a.plan(t, pop_a), b.plan(t, pop_b)
            assert dict(pa) == dict(pb)
            assert dict(a.persist_plan(t, pa)) == dict(b.persist_plan(t, pb))
            pop_a.mark_full(t, _full_experts(pa))
            pop_b.mark_full(t, _full_experts(pb))


def test_config_errors():
    with pytest.raises(ValueError, match="k_persist"):
        PECConfig(k_snapshot=1, k_persist=2)
    with pytest.raises(ValueError, match="selection"):
        PECConfig(selection="random")
    with pytest.raises(ValueError, match="needs expert operators"):
        PECPolicy(PECConfig(), [i for i in make_catalog(1, 2) if not i.op.is_expert])
    with pytest.raises(ValueError, match="pass the ExpertPopularity"):
        PECPolicy(PECConfig(selection="load_aware"), make_catalog(1, 2)).plan(0)
    with pytest.raises(ValueError, match="non-negative"):
        PECPolicy(PECConfig(), make_catalog(1, 2)).on_recovery(0, -0.1)
