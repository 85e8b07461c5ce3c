"""What a policy means outside itself: recovery and retention rules, lossiness, token-loss
denominators, persist plans, flag checks, and how the measured iteration time feeds windows and budgets
(``T_iter`` measured continuously). No module outside ``moe_ft/policy`` decides these by name."""

from __future__ import annotations

import pytest
from test_policy_common import make_catalog

from moe_ft.config import FTConfig
from moe_ft.policy import POLICIES, build_policy, policy_class
from moe_ft.policy.sparse import SparseConfig, SparsePolicy
from moe_ft.store import DenseRule, NewestFullRule, SparseWindowRule


def test_rules_and_loss_belong_to_the_policy():
    ops = make_catalog(2, 4)
    ids = [i.op for i in ops]
    dense = build_policy("dense", {"interval": 2}, ops)
    pec = build_policy("pec", {"k_snapshot": 1}, ops)
    sel = build_policy("selective", {"local_budget": 10**9, "remote_budget": 10**9}, ops)
    sparse = build_policy("sparse", {"window": 3}, ops)
    sparse.plan(6)
    assert isinstance(dense.recovery_rule(ids), DenseRule) and not dense.lossy and dense.dense_points
    assert isinstance(pec.recovery_rule(ids), NewestFullRule) and pec.lossy and pec.token_loss_metric == "PLT"
    assert isinstance(sel.recovery_rule(ids), NewestFullRule) and sel.lossy and sel.token_loss_metric == "MLT"
    assert isinstance(sparse.recovery_rule(ids), SparseWindowRule) and not sparse.lossy
    # retention keeps windows aligned to the current one (opened at 6, length 3): [6, 8] is one, [7, 9] is not
    rule = sparse.retention_rule(ids)
    assert rule.window_of(8) == (6, 8) and rule.window_of(9) is None and rule.window_of(5) == (3, 5)
    # PLT over the whole run (MoC eq. 7), MLT over the tokens so far (MoEtion eq. 6)
    assert pec.token_loss_denominator(9, train_iters=100, tokens_per_iteration=5.0) == 500.0
    assert sel.token_loss_denominator(9, train_iters=100, tokens_per_iteration=5.0) == 50.0
    with pytest.raises(ValueError, match="exact"):
        sparse.token_loss_denominator(9, train_iters=100, tokens_per_iteration=5.0)
    before = pec.k
    assert pec.after_recovery(9, 0.5) == {"k_before": before, "k_after": pec.k} and pec.k == 2 * before
    assert dense.after_recovery(9, 0.0) == {} and dense.persist_plan(0, dense.plan(0)) is None
    assert pec.persist_plan(0, pec.plan(0)) is not None  # K_persist experts (MoC §5.1)
    assert sparse.window_progress(7) == "2/3" and dense.window_progress(7) is None


def test_flag_rules_are_asked_of_the_policy_class():
    assert policy_class("none") is None and {n: policy_class(n).lossy for n in POLICIES} == {
        "dense": False, "pec": True, "selective": True, "sparse": False}
    with pytest.raises(ValueError, match="unknown snapshot policy"):
        policy_class("lru")
    with pytest.raises(ValueError, match="--ft-persist-interval 2 with --ft-policy pec"):
        FTConfig.from_flags(ft_policy="pec", ft_persist_interval=2)
    with pytest.raises(ValueError, match="pec or selective"):
        FTConfig.from_flags(ft_policy="dense", ft_capacity_boost=0.1)
    cfg = FTConfig.from_flags(ft=True, ft_policy="selective", ft_persist_interval=3, ft_fail=["1:4:persist"])
    assert (cfg.snapshot.policy, cfg.persist.interval, cfg.drill.fail) == ("selective", 3, ["1:4:persist"])
    assert cfg.needs_popularity and not FTConfig.from_flags(ft_policy="dense").needs_popularity
    with pytest.raises(ValueError, match="no flag"):
        FTConfig.from_flags(ft_persist_interva=1)


def test_flags_keep_their_names():
    import argparse

    from megatron.training.argument_utils import add_dataclass_arguments

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, FTConfig, "fault tolerance")
    flags = {a for action in parser._actions for a in action.option_strings}
    for name in ("--ft", "--ft-policy", "--ft-store-dir", "--ft-job-id", "--ft-sparse-window", "--ft-replicas",
                 "--ft-ranks-per-node", "--ft-persist-interval", "--ft-persist-dir", "--ft-fail", "--ft-digest-out",
                 "--ft-trace-out", "--ft-recover", "--ft-hang-timeout", "--ft-report-dir", "--ft-capacity-boost",
                 "--ft-log-interval", "--ft-snapshot-slots", "--ft-pec-k", "--ft-selective-local-budget"):
        assert name in flags, name


def test_selective_budget_follows_measured_iteration_time():
    ops = make_catalog(2, 4)
    flags = FTConfig.from_flags(ft_policy="selective", ft_snapshot_bandwidth=1e4).snapshot
    policy = build_policy("selective", policy_class("selective").config_from_flags(flags, 1.0), ops)
    assert policy.config.local_budget == 10_000
    policy.observe_iteration_time(0.5)
    assert (policy.config.local_budget, policy.config.remote_budget) == (5_000, 5_000)
    non_expert = max(policy._non_expert_bytes.values())
    policy.observe_iteration_time(1e-9)  # never below the non-expert bytes saved every iteration and one expert
    assert policy.config.local_budget == non_expert + max(i.bytes_full for i in ops if i.op.is_expert)
    fixed = FTConfig.from_flags(ft_policy="selective", ft_selective_local_budget=7_000).snapshot
    pinned = build_policy("selective", policy_class("selective").config_from_flags(fixed, 1.0), ops)
    pinned.observe_iteration_time(0.5)
    assert pinned.config.local_budget == 7_000  # a budget given by flag stays


def test_sparse_auto_window_is_found_again_when_t_iter_changes():
    ops = make_catalog(2, 4, expert_full=300, expert_compute=100)
    total = sum(i.bytes_full for i in ops)
    policy = SparsePolicy(SparseConfig(window="auto", bandwidth_bytes_per_s=total, t_iter_s=1.0), ops)
    policy.plan(0)
    first = policy.current.length
    policy.observe_iteration_time(1.0)
    policy.plan(first)  # next boundary, same T_iter: same length
    assert policy.current.length == first and policy.current.start == first
    policy.observe_iteration_time(0.2)  # the link now moves a fifth of the bytes per iteration
    start = policy.current.end
    policy.plan(start)
    assert policy.current.start == start and policy.current.length > first
    assert policy.previous.length == first  # the window just finished keeps its geometry (recovery)
    fixed = SparsePolicy(SparseConfig(window=2), ops)
    fixed.plan(0)
    fixed.observe_iteration_time(0.01)
    fixed.plan(2)
    assert fixed.current.length == 2


def test_iteration_clock_median_and_agreement_without_process_group():
    from moe_ft.runtime.components import IterationClock

    clock = IterationClock(window=3, sync_every=2)
    assert clock.median_recent() is None and clock.tick() is None  # nothing measured yet
    clock.seconds.update({0: 9.0, 1: 1.0, 2: 2.0, 3: 3.0})  # the warm-up iteration falls out of the window
    assert clock.median_recent() == 2.0
    assert clock.tick() == 2.0 and clock.t_iter_s == 2.0
    clock.seconds[4] = 10.0
    assert clock.tick() is None  # agreed every 2 ticks only
    assert clock.tick() == 3.0
