"""The simulator models what the runtime does, and ``moe-ft plan`` prints the flags that run it:

* one copy budget for both (``moe_ft.policy.window.snapshot_copy_bandwidth``): the runtime's sparse window and
  selective ``B_remote`` are bounded by the replication bandwidth over the replicas, as the planner's are;
* ``launcher=`` applies to every policy (``moe-ft launch`` recovers whatever the policy), the paper
  baselines ``gemini``, ``checkfreq`` and ``moc`` restart the job;
* replay charges frozen operators what the runtime spends on them (their weight gradients are computed and
  dropped: 1), MoEvement's 2/3 only under ``sparse:localized=paper``;
* ``--ft-pec-fixed-k`` runs the fixed-K rows (``pec:k=N``, ``pec:k=fit``)."""

import argparse
import dataclasses

import pytest

from megatron.training.argument_utils import add_dataclass_arguments, dataclass_from_args
from moe_ft.config import FTConfig
from moe_ft.policy import SparsePolicy, build_policy, policy_class
from moe_ft.policy.window import snapshot_copy_bandwidth
from moe_ft.sim.advisor import plan
from moe_ft.sim.analytic import build_model, evaluate
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.policies import parse_policy, selective_budgets, sparse_model
from moe_ft.sim.presets import get_preset
from moe_ft.state.operators import OperatorInfo


@pytest.fixture(scope="module")
def cost():
    return CostModel(get_preset("deepseek-moe-16b"))


def _parse(argv) -> FTConfig:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, FTConfig, "fault tolerance")
    return dataclass_from_args(FTConfig, parser.parse_args(list(argv)))


def _catalogue(cost: CostModel) -> list[OperatorInfo]:
    """Each stage's rank as one device of the runtime's catalogue (the simulator's per-rank bytes)."""
    return [OperatorInfo(op=o.op, bytes_full=int(o.bytes_full), bytes_compute=int(o.bytes_compute), pp_rank=s)
            for s in range(cost.config.parallel.pp) for o in cost.rank_operators(s)]


def test_copy_bandwidth_is_the_link_that_bounds_the_snapshot():
    assert snapshot_copy_bandwidth(snapshot_bandwidth=20e9) == 20e9  # MoEvement Alg. 1: B_PCIe alone
    assert snapshot_copy_bandwidth(snapshot_bandwidth=20e9, replication_bandwidth=1.25e9, num_replicas=2) == 0.625e9
    assert snapshot_copy_bandwidth(snapshot_bandwidth=1e9, replication_bandwidth=8e9, num_replicas=2) == 1e9
    # unknown replication bandwidth (0: the sender is unlimited) or no replicas: the device link alone
    assert snapshot_copy_bandwidth(snapshot_bandwidth=20e9, replication_bandwidth=0.0, num_replicas=2) == 20e9
    assert snapshot_copy_bandwidth(snapshot_bandwidth=20e9, replication_bandwidth=1e9, num_replicas=0) == 20e9
    with pytest.raises(ValueError, match="snapshot bandwidth must be positive"):
        snapshot_copy_bandwidth(snapshot_bandwidth=0.0)


def test_runtime_and_planner_pick_the_same_sparse_window(cost):
    """deepseek-moe-16b: the planner's W = 2 is what the runtime picks from the same bandwidths and T_iter; the
    runtime once ignored the replicas and took W = 1, whose 3.09 GB per rank and iteration two replicas at
    1.25 GB/s cannot carry within the 4.71 s iteration."""
    hw, t_iter = cost.config.hardware, cost.iteration.t_iter_s
    planned = sparse_model(cost, parse_policy("sparse"))
    flags = FTConfig.from_flags(ft_policy="sparse", ft_snapshot_bandwidth=hw.d2h_bandwidth,
                                ft_replication_bandwidth=hw.network_bandwidth,
                                ft_replicas=cost.config.recovery.replicas)
    config = SparsePolicy.config_from_flags(flags.snapshot, t_iter, replication=flags.replication)
    policy = SparsePolicy(config, _catalogue(cost))
    policy.plan(0)
    assert policy.current.length == planned.period_iters == 2
    busiest = max(s.peak_bytes for s in policy.slicing.values())
    assert cost.config.recovery.replicas * busiest / hw.network_bandwidth <= t_iter  # the replicas keep up
    # without the replication bound the device link alone takes every operator at once
    alone = SparsePolicy(SparsePolicy.config_from_flags(flags.snapshot, t_iter), _catalogue(cost))
    alone.plan(0)
    assert alone.current.length == 1


def test_plan_prints_the_flags_that_run_each_row(cost):
    recs = {r.result.policy: r for r in plan(cost, 1800.0)}
    sparse = recs["sparse"]
    assert sparse.run.launcher.startswith("moe-ft launch")
    assert "--ft-sparse-window" in sparse.run.flags
    parsed = _parse(sparse.run.flags)
    config = SparsePolicy.config_from_flags(parsed.snapshot, cost.iteration.t_iter_s, replication=parsed.replication)
    assert config.window == sparse.result.window and parsed.replication.replicas == cost.config.recovery.replicas
    assert _parse(recs["sparse:localized=0"].run.flags).recovery.recovery_scope == "global"
    gemini = _parse(recs["gemini"].run.flags)
    assert recs["gemini"].run.launcher == "torchrun"
    assert (gemini.snapshot.policy, gemini.snapshot.dense_interval) == ("dense", recs["gemini"].result.interval)
    selective = _parse(recs["selective"].run.flags).snapshot
    local, remote = selective_budgets(cost)
    assert (selective.selective_local_budget, selective.selective_remote_budget) == (int(local), int(remote))
    paper = plan(cost, 1800.0, policies=("sparse:localized=paper",))[0]
    assert paper.run.flags is None and "not what moe-ft runs" in str(paper.run)


def test_selective_remote_budget_is_bounded_by_the_replicas():
    ops = _catalogue(CostModel(get_preset("deepseek-moe-16b")))
    flags = FTConfig.from_flags(ft_policy="selective", ft_snapshot_bandwidth=20e9, ft_replication_bandwidth=1.25e9,
                                ft_replicas=2)
    config = policy_class("selective").config_from_flags(flags.snapshot, 4.0, replication=flags.replication)
    assert (config.local_budget, config.remote_budget) == (80e9, 2.5e9)
    policy = build_policy("selective", config, ops)
    policy.observe_iteration_time(5.0)  # both follow the measured T_iter
    assert (policy.config.local_budget, policy.config.remote_budget) == (100e9, 3.125e9)
    unbounded = policy_class("selective").config_from_flags(flags.snapshot, 4.0)
    assert unbounded.remote_budget == unbounded.local_budget == 80e9


@pytest.mark.parametrize("kind", ["dense:interval=5", "pec:k=8", "selective", "sparse"])
def test_the_launcher_applies_to_every_policy(cost, kind):
    """``moe-ft launch`` recovers every policy in-process; ``launcher=torchrun`` restarts every rank."""
    rec = cost.config.recovery
    inprocess = build_model(cost, parse_policy(kind), 1800.0)
    torchrun = build_model(cost, parse_policy(f"{kind}:launcher=torchrun"), 1800.0)
    assert torchrun.restart_load_s() - inprocess.restart_load_s() == pytest.approx(
        rec.restart_s - rec.inprocess_detect_s - rec.inprocess_reform_s)


def test_the_paper_baselines_restart_the_job(cost):
    for alias in ("gemini", "checkfreq", "moc"):
        assert parse_policy(alias).launcher == "torchrun", alias
    assert parse_policy("dense-daly").launcher == parse_policy("moetion").launcher == "inprocess"


def test_replay_charges_frozen_operators_what_the_runtime_spends(cost):
    """The runtime computes a frozen operator's weight gradient and drops it: replaying a window costs as much
    as replaying it with every operator active. MoEvement's model (``localized=paper``) saves a third."""
    every_active = dataclasses.replace(cost.config, recovery=dataclasses.replace(
        cost.config.recovery, frozen_cost=1.0, paper_frozen_cost=1.0))
    full = CostModel(every_active)
    for spec in ("sparse", "sparse:localized=0", "sparse:launcher=torchrun"):
        pm, ref = sparse_model(cost, parse_policy(spec)), sparse_model(full, parse_policy(spec))
        assert pm.frozen_cost == 1.0
        assert pm.recovery_s(0.0, 7) == pytest.approx(ref.recovery_s(0.0, 7))
    paper = sparse_model(cost, parse_policy("sparse:localized=paper"))
    assert paper.frozen_cost == pytest.approx(2 / 3)
    assert paper.recovery_s(0.0, 7) < sparse_model(full, parse_policy("sparse:localized=paper")).recovery_s(0.0, 7)


def test_fixed_k_flag_keeps_k_when_plt_would_double_it(cost):
    catalogue = _catalogue(CostModel(get_preset("deepseek-moe-16b")))
    for argv, k_after in ((["--ft-pec-fixed-k"], 2), ([], 4)):
        config = _parse(["--ft", "--ft-policy", "pec", "--ft-pec-k", "2", *argv])
        policy = build_policy("pec", policy_class("pec").config_from_flags(config.snapshot, 1.0), catalogue)
        assert policy.after_recovery(10, 0.05) == {"k_before": 2, "k_after": k_after}  # PLT 5 % > 3.75 %
    fit = plan(cost, 1800.0, policies=("pec:k=fit", "moc"))
    flags = {r.result.policy: r.run.flags for r in fit}
    assert "--ft-pec-fixed-k" in flags["pec:k=fit"] and "--ft-pec-fixed-k" not in flags["moc"]
    k = evaluate(cost, parse_policy("pec:k=fit"), 1800.0).knobs["k"]
    assert _parse(flags["pec:k=fit"]).snapshot.pec_k == k
