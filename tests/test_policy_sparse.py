import random

import pytest
import torch
from test_policy_common import feed, make_catalog, make_popularity

from moe_ft.policy import SparseConfig, SparsePolicy
from moe_ft.policy.sparse_schedule import layer_shares, layout_window, order_operators, should_reorder
from moe_ft.policy.window import find_window_size
from moe_ft.state.operators import Level, OperatorId, OperatorInfo


def _run(policy, pop, iterations, rng, skew):
    plans = []
    for t in iterations:
        feed(pop, t, rng, skew=skew)
        plans.append((t, policy.plan(t, pop)))
    return plans


def test_every_operator_full_exactly_once_per_window_and_compute_until_then():
    rng = random.Random(0)
    for case in range(25):
        layers, experts = rng.randint(1, 4), rng.choice([2, 4, 6, 8])
        ep = rng.choice([d for d in (1, 2, 4) if experts % d == 0])
        ops = make_catalog(layers, experts, ep=ep, pp=rng.randint(1, 2), rng=rng)
        window = rng.choice(["auto", rng.randint(1, 12)])
        cfg = SparseConfig(window=window, bandwidth_bytes_per_s=rng.choice([1500.0, 4000.0, 20000.0]),
                           t_iter_s=1.0, order=rng.choice(["popularity", "soft", "ema"]),
                           reorder_fraction=rng.choice([0.25, 0.5]))
        policy, pop = SparsePolicy(cfg, ops), make_popularity(layers, experts)
        first = rng.randint(0, 50)
        windows = {}  # start -> (length, [plans])
        foreseen = {}  # start -> the window's plans as recovery_point_plans() gave them at its first iteration
        for t in range(first, first + 60):
            feed(pop, t, rng, skew=rng.choice([0.0, 1.0, 3.0]))
            plan = policy.plan(t, pop)
            win = policy.window_of(t)
            windows.setdefault(win.start, (win.length, []))[1].append(plan)
            if t == win.start:
                foreseen[t] = policy.recovery_point_plans()
        starts = sorted(windows)
        assert starts[0] == first
        for s0, s1 in zip(starts, starts[1:]):  # windows tile the iterations
            assert s1 == s0 + windows[s0][0]
        complete = [plans for start, (length, plans) in windows.items() if len(plans) == length]
        assert complete, "the run must cover at least one whole window"
        assert all(foreseen[start] == plans for start, (length, plans) in windows.items() if len(plans) == length)
        for plans in complete:
            full_count = {i.op: 0 for i in ops}
            for plan in plans:
                assert set(plan) == set(full_count)
                for op, level in plan.items():
                    done = full_count[op] > 0
                    if level == Level.FULL:
                        assert not done, f"{op} FULL twice in one window (case {case})"
                        full_count[op] += 1
                    else:
                        assert level == (Level.NONE if done else Level.COMPUTE), (case, op, level)
            assert set(full_count.values()) == {1}, case


def test_auto_window_fits_every_device_link_and_matches_find_window_size_on_one_device():
    rng = random.Random(1)
    fitting = 0
    for _ in range(40):
        layers, experts = rng.randint(1, 4), rng.choice([4, 8])
        ep, pp = rng.choice([1, 2, 4]), rng.randint(1, 2)
        ops = make_catalog(layers, experts, ep=ep, pp=pp, rng=rng)
        bandwidth = rng.choice([2000.0, 5000.0, 1e9])
        policy, pop = SparsePolicy(SparseConfig(bandwidth_bytes_per_s=bandwidth, t_iter_s=1.0), ops), \
            make_popularity(layers, experts)
        plans = _run(policy, pop, range(2 * policy_window(policy, pop)), rng, skew=1.0)
        if all(s.fits for s in policy.slicing.values()):
            fitting += 1
            for _, plan in plans:
                assert max(policy.plan_bytes(plan).values()) <= bandwidth
        else:  # a device that cannot fit even one FULL operator per iteration stalls, as Alg. 1 says
            assert policy.current.length == max(s.num_ops for s in policy.slicing.values())
        if ep == 1 and pp == 1:
            order = policy.current.order
            info = {i.op: i for i in ops}
            choice = find_window_size([info[o].bytes_full for o in order], [info[o].bytes_compute for o in order],
                                      bandwidth_bytes_per_s=bandwidth, t_iter_s=1.0)
            assert policy.current.length == choice.window
    assert fitting >= 20


def policy_window(policy, pop):
    policy.plan(-1, pop)  # opens the first window, before any tokens were counted
    return policy.current.length


def test_order_is_ascending_popularity_with_non_experts_last():
    ops = make_catalog(2, 4, ep=1)
    pop = make_popularity(2, 4)
    pop.record(0, torch.tensor([5, 1, 9, 3]))
    pop.record(1, torch.tensor([2, 8, 0, 7]))
    pop.end_iteration(0)
    policy = SparsePolicy(SparseConfig(window=len(ops)), ops)  # one operator per iteration
    policy.plan(0, pop)
    e = OperatorId.expert_op
    assert list(policy.current.order[:8]) == [e(1, 2), e(0, 1), e(1, 0), e(0, 3), e(0, 0), e(1, 3), e(1, 1), e(0, 2)]
    assert all(not op.is_expert for op in policy.current.order[8:])
    schedule = policy.window_of(0).activation_schedule()
    assert schedule[e(1, 2)] == 0 and schedule[e(0, 2)] == 7 and schedule[OperatorId.output()] == len(ops) - 1
    # capacity ordering divides by capacity: expert (0, 2) with capacity 100 becomes the least popular
    cap = SparsePolicy(SparseConfig(window=len(ops), order="capacity", capacity={"expert.L0.E2": 100.0}), ops)
    cap.plan(0, pop)
    assert cap.current.order[:2] == (e(1, 2), e(0, 2))


def test_should_reorder_threshold_cases():
    e = [OperatorId.expert_op(0, j) for j in range(8)]
    ref = {op: 1 / 8 for op in e}
    one_changed = {**ref, e[0]: 0.5 / 8, e[1]: 1.5 / 8}  # 2 of 8 = 25 % by 50 %
    assert should_reorder(ref, one_changed, change=0.1, fraction=0.25)
    assert not should_reorder(ref, one_changed, change=0.1, fraction=0.3)
    small = {op: v * (1.09 if i % 2 else 0.91) for i, (op, v) in enumerate(ref.items())}  # all by 9 %
    assert not should_reorder(ref, small, change=0.1, fraction=0.25)
    assert should_reorder({op: 0.0 for op in e}, ref, change=0.1, fraction=0.25)
    assert not should_reorder({op: 0.0 for op in e}, {op: 0.0 for op in e}, change=0.1, fraction=0.25)


def test_reorder_only_at_window_boundaries_and_only_past_threshold():
    rng = random.Random(2)
    outcomes = set()
    for case in range(12):
        layers, experts = rng.randint(1, 3), rng.choice([4, 8])
        ops = make_catalog(layers, experts, rng=rng)
        policy = SparsePolicy(SparseConfig(window=rng.randint(2, 6), order=rng.choice(["popularity", "ema"])), ops)
        pop = make_popularity(layers, experts)
        reference, order, start = None, None, None
        for t in range(40):
            feed(pop, t, rng, skew=rng.choice([0.5, 2.0]), tokens=16)
            scores = policy.scores(pop)
            prev_current = policy.current
            policy.plan(t, pop)
            if prev_current is None:
                reference, order, start = layer_shares(scores), policy.current.order, t
                continue
            boundary = t >= prev_current.end
            if not boundary:
                assert policy.current.order == order and policy.current.start == start
                continue
            expect = should_reorder(reference, layer_shares(scores), change=0.1, fraction=0.25)
            outcomes.add(expect)
            # independent count of the threshold rule
            shares = layer_shares(scores)
            changed = sum((abs(shares[o] - reference[o]) > 0.1 * reference[o]) if reference[o] > 0 else shares[o] > 0
                          for o in shares)
            assert expect == (changed >= 0.25 * len(shares))
            assert policy.current.start == prev_current.end
            if expect:
                reference = shares
                assert list(policy.current.order) == order_operators(ops, scores)
            else:
                assert policy.current.order == order
            order, start = policy.current.order, policy.current.start
    assert outcomes == {True, False}, "both a reorder and a kept order must be exercised"


def test_replay_of_previous_window_and_forgotten_windows():
    ops = make_catalog(2, 4)
    policy, pop = SparsePolicy(SparseConfig(window=3), ops), make_popularity(2, 4)
    plans = {t: plan for t, plan in _run(policy, pop, range(10, 17), random.Random(3), skew=2.0)}
    assert (policy.previous.start, policy.current.start) == (13, 16)
    for t in (13, 14, 15):  # replay after a failure at 16: same plans, same schedule
        assert dict(policy.plan(t, pop)) == dict(plans[t])
        assert policy.window_of(t).activation_iteration(OperatorId.output()) == 15
    with pytest.raises(ValueError, match="no remembered window"):
        policy.window_of(12)
    assert policy.recovery_window(16).start == 13  # failure during 16: window [13, 16) is complete
    assert policy.recovery_window(17).start == 13
    with pytest.raises(ValueError, match="no complete window"):
        policy.recovery_window(15)
    for t in range(17, 20):
        policy.plan(t, pop)
    assert policy.recovery_window(19).start == 16


def test_state_dict_round_trip_continues_the_same_schedule():
    rng = random.Random(4)
    for _ in range(6):
        ops = make_catalog(3, 4, ep=2, rng=rng)
        cfg = SparseConfig(bandwidth_bytes_per_s=3000.0, t_iter_s=1.0, order="ema")
        a, pop_a = SparsePolicy(cfg, ops), make_popularity(3, 4)
        cut = rng.randint(1, 30)
        _run(a, pop_a, range(cut), rng, skew=2.0)
        b, pop_b = SparsePolicy(cfg, ops), make_popularity(3, 4)
        b.load_state_dict(a.state_dict())
        pop_b.load_state_dict(pop_a.state_dict())
        for t in range(cut, cut + 30):
            seed = rng.randrange(10**6)
            feed(pop_a, t, random.Random(seed), skew=2.0)
            feed(pop_b, t, random.Random(seed), skew=2.0)
            assert dict(a.plan(t, pop_a)) == dict(b.plan(t, pop_b))
        assert a.state_dict() == b.state_dict()
    other = SparsePolicy(SparseConfig(window=2), make_catalog(1, 2))
    with pytest.raises(ValueError, match="different operator catalogue"):
        other.load_state_dict(a.state_dict())


def _encoded_afresh(policy) -> dict:
    """The policy's state encoded from its objects, with nothing remembered (what ``state_dict`` must equal)."""
    return {"name": policy.name,
            "current": None if policy.current is None else policy.current.to_dict(),
            "previous": None if policy.previous is None else policy.previous.to_dict(),
            "reference": {str(op): v for op, v in sorted(policy._reference.items())},
            "slicing": {f"{k[0]},{k[1]}": vars(v) for k, v in sorted(policy.slicing.items())},
            "num_reorders": policy.num_reorders}


def test_remembered_plans_and_state_equal_what_the_windows_give_through_reorders_and_dense_points():
    """``plan`` and ``state_dict`` run on the training thread every iteration and remember what repeats
    (the plan of each offset while the slices are the same object, the encoded windows and reference):
    across reorders, T_iter changes, a dense window and a restored state, each answer equals the one
    computed afresh from the windows."""
    rng = random.Random(5)
    reorders = 0
    for case in range(8):
        layers, experts = rng.randint(1, 3), rng.choice([4, 8])
        ops = make_catalog(layers, experts, ep=rng.choice([1, 2]), rng=rng)
        cfg = SparseConfig(window=rng.choice(["auto", 3, 5]), bandwidth_bytes_per_s=3000.0, t_iter_s=1.0,
                           order=rng.choice(["popularity", "ema"]), reorder_fraction=0.25)
        policy, pop = SparsePolicy(cfg, ops), make_popularity(layers, experts)
        states = []
        for t in range(60):
            feed(pop, t, rng, skew=rng.choice([0.0, 0.5, 3.0]), tokens=16)
            if t == 20:
                policy.observe_iteration_time(rng.choice([0.5, 2.0]))
            if t == 31:
                policy.start_dense(t)
            if t == 45:  # a restored state: the remembered parts belong to objects that are gone
                fresh = SparsePolicy(cfg, ops)
                fresh.load_state_dict(policy.state_dict())
                policy = fresh
            plan = policy.plan(t, pop)
            assert dict(plan) == dict(policy.window_of(t).plan(t)), (case, t)
            state = policy.state_dict()
            assert state == _encoded_afresh(policy), (case, t)
            states.append((t, state, _encoded_afresh(policy)))
        for t, state, afresh in states:  # an earlier answer is not changed by later ones
            assert state == afresh, (case, t)
        reorders += policy.num_reorders
    assert reorders > 0, "a reorder must be exercised"


def test_fixed_window_longer_than_a_device_list_leaves_late_slices_empty():
    ops = [OperatorInfo(op=OperatorId.expert_op(0, e), bytes_full=3, bytes_compute=1) for e in range(3)]
    window, slices, report = layout_window(ops, [i.op for i in ops], window=5, bandwidth_bytes_per_s=None,
                                           t_iter_s=None)
    assert window == 5 and sorted(slices.values()) == [0, 1, 2] and report[(0, 0)].fits is None


def test_config_errors_are_actionable():
    with pytest.raises(ValueError, match="needs bandwidth"):
        SparseConfig()
    with pytest.raises(ValueError, match="needs SparseConfig.capacity"):
        SparseConfig(window=2, order="capacity")
    with pytest.raises(ValueError, match="order must be one of"):
        SparseConfig(window=2, order="random")
    with pytest.raises(ValueError, match="unknown experts"):
        SparsePolicy(SparseConfig(window=2, order="capacity", capacity={"expert.L9.E0": 1.0}), make_catalog(1, 2))
