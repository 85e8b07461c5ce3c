"""Cost model: bytes per operator and rank, 1F1B iteration time, sparse window from FindWindowSize."""

import dataclasses
import math

import pytest

from moe_ft.policy.window import find_window_size
from moe_ft.sim.advisor import explain
from moe_ft.sim.analytic import build_model, choose_dense_interval, evaluate
from moe_ft.sim.config import (
    PRECISIONS,
    CollectiveCost,
    HardwareSpec,
    ModelSpec,
    ParallelSpec,
    SimConfig,
    config_from_dict,
)
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.policies import _budget_bytes, _checkpoint_order, dense_model, parse_policy, sparse_model
from moe_ft.sim.presets import get_preset
from moe_ft.state.operators import OperatorId

ZERO = CollectiveCost(alpha_s=0.0, beta_s_per_byte=0.0)
TINY_MODEL = ModelSpec(num_layers=2, hidden_size=4, ffn_hidden_size=8, moe_ffn_hidden_size=2, num_experts=4,
                       top_k=2, vocab_size=10, seq_length=4)


def tiny(pp=1, dp=2, ep=2, d2h=1e9, **hw):
    hardware = HardwareSpec(peak_flops_bf16=1e12, mfu=0.5, d2h_bandwidth=d2h, nvlink_bandwidth=1e9,
                            network_bandwidth=1e9, collectives={k: ZERO for k in
                                                                ("all_to_all", "all_reduce", "reduce_scatter",
                                                                 "all_gather", "p2p")}, **hw)
    return SimConfig(model=TINY_MODEL, parallel=ParallelSpec(pp=pp, dp=dp, ep=ep, micro_batch_size=1,
                                                             global_batch_size=4 * dp),
                     precision=PRECISIONS["mixed"], hardware=hardware)


def test_parameter_counts_by_hand():
    cm = CostModel(tiny())
    assert cm.expert_params() == 3 * 4 * 2  # SwiGLU: 3·h·f
    assert cm.operator_params(OperatorId.dense(0)) == 4 * 16 + 2 * 4  # attention 4h² + two norms
    assert cm.operator_params(OperatorId.gate(0)) == 4 * 4 + 4
    assert cm.total_params() == 40 + 40 + 2 * (72 + 20 + 4 * 24)  # = 456
    assert cm.active_params() == 456 - 2 * 2 * 24


def test_rank_bytes_sharded_over_replicas():
    cm = CostModel(tiny())  # dp 2, ep 2: non-expert state has 2 replicas, experts 1
    ops = {str(o.op): o for o in cm.rank_operators(0)}
    assert set(k for k in ops if k.startswith("expert")) == {"expert.L0.E0", "expert.L0.E1",
                                                            "expert.L1.E0", "expert.L1.E1"}
    e = ops["expert.L0.E0"]
    assert (e.bytes_compute, e.bytes_full) == (24 * 2, 24 * (2 + 4 + 8))
    d = ops["dense.L0"]
    assert (d.bytes_compute, d.bytes_full) == (72 * 2 / 2, 72 * 14 / 2)
    held = cm.rank_state_bytes(0)
    assert held["compute"] == 2 * (40 + 40 + 2 * (72 + 20 + 2 * 24))


def test_iteration_time_1f1b_by_hand():
    cm = CostModel(tiny(pp=2, dp=1, ep=1))
    # per-token forward FLOPs: layer = 2·72 + 2·s·h (32) + gate 2·20 + experts 4·(2·24·2/4) = 312; output 2·40
    rate = 1e12 * 0.5
    stage1 = 3 * 4 * (312 + 80) / rate  # tokens per micro-batch = 1 · 4
    it = cm.iteration
    assert it.stage_math_s[1] == pytest.approx(stage1)
    assert it.stage_times_s[0] == pytest.approx(3 * 4 * 312 / rate)
    assert it.t_pipeline_s == pytest.approx((4 + 2 - 1) * stage1)  # M = 4, S = 2


def test_sparse_window_uses_find_window_size():
    cfg = tiny(d2h=1.0)
    cm = CostModel(cfg)
    pm = sparse_model(cm, parse_policy("sparse"))
    ops = _checkpoint_order(cm.rank_operators(0))
    assert [o.op.is_expert for o in ops[:4]] == [True] * 4  # experts first, the always-used operators last
    budget = _budget_bytes(cm)
    want = find_window_size([o.bytes_full for o in ops], [o.bytes_compute for o in ops],
                            bandwidth_bytes_per_s=budget / cm.iteration.t_iter_s, t_iter_s=cm.iteration.t_iter_s)
    assert pm.windows[0] == want and pm.period_iters == want.window


def test_sparse_window_shrinks_with_bandwidth():
    windows = []
    for d2h in (1e3, 1e5, 1e7, 1e12):
        cfg = tiny(d2h=d2h)
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, network_bandwidth=1e15))
        windows.append(sparse_model(CostModel(cfg), parse_policy("sparse")))
    assert [w.period_iters for w in windows] == sorted((w.period_iters for w in windows), reverse=True)
    # copies hidden: what remains is the trainer's host work on the bytes (HardwareSpec.host_s_per_byte)
    host = windows[-1].cost.config.hardware.host_s_per_byte
    assert windows[-1].period_iters == 1 and windows[-1].stall_s == pytest.approx(windows[-1].checkpoint_bytes * host)
    assert windows[0].stall_s > 0  # even one operator per iteration cannot be hidden


def test_t_ckpt_is_the_trainers_host_work_when_the_copies_are_hidden():
    """The simulator's T_ckpt is not 0 where the copy fits: the trainer still hashes and writes every snapshot
    byte on its host (measured on an H100: 0.13-0.16 ms per MB); a trainer that touches no byte costs 0."""
    def model(host_s_per_byte):
        cfg = tiny(d2h=1e12)
        hw = dataclasses.replace(cfg.hardware, network_bandwidth=1e15, host_s_per_byte=host_s_per_byte)
        return dense_model(CostModel(dataclasses.replace(cfg, hardware=hw)), parse_policy("dense:interval=1"), 1)

    assert model(0.0).stall_s == 0
    measured = model(1.5e-10)
    assert measured.stall_s == pytest.approx(measured.checkpoint_bytes * 1.5e-10) and measured.overhead > 0
    with pytest.raises(ValueError, match="host_s_per_byte"):
        model(-1.0)


def test_a_cost_per_snapshot_is_charged_once_per_snapshot_whatever_its_size():
    """``host_s_per_snapshot``: the trainer's host work per point (the arena path's cost, measured per snapshot
    rather than per byte): once per dense checkpoint, once per iteration of a sparse window, PEC and selective."""
    def cost(per_snapshot):
        cfg = tiny(d2h=1e12)
        hw = dataclasses.replace(cfg.hardware, network_bandwidth=1e15, host_s_per_byte=0.0,
                                 host_s_per_snapshot=per_snapshot)
        return CostModel(dataclasses.replace(cfg, hardware=hw))

    dense = dense_model(cost(0.01), parse_policy("dense:interval=4"), 4)
    assert dense.stall_s == pytest.approx(0.01) and dense.overhead == pytest.approx(0.01 / (4 * dense.t_iter_s))
    sparse = sparse_model(cost(0.01), parse_policy("sparse"))
    assert sparse.stall_s == pytest.approx(0.01 * sparse.period_iters)
    assert sparse.overhead == pytest.approx(0.01 / sparse.t_iter_s)
    for spec in ("pec:k=1", "selective"):
        assert build_model(cost(0.01), parse_policy(spec), 3600.0).stall_s == pytest.approx(0.01)
        assert build_model(cost(0.0), parse_policy(spec), 3600.0).stall_s == 0
    with pytest.raises(ValueError, match="host_s_per_snapshot must be >= 0"):
        cost(-0.5)


def test_config_validation_messages():
    good = {"model": dataclasses.asdict(TINY_MODEL),
            "parallel": {"pp": 1, "dp": 2, "ep": 2, "micro_batch_size": 1, "global_batch_size": 8},
            "hardware": {"peak_flops_bf16": 1e12, "d2h_bandwidth": 1e9, "nvlink_bandwidth": 1e9,
                         "network_bandwidth": 1e9}}
    assert config_from_dict(good).parallel.num_microbatches == 4
    with pytest.raises(ValueError, match="valid keys"):
        config_from_dict({**good, "model": {**good["model"], "hiden_size": 3}})
    with pytest.raises(ValueError, match="must divide dp"):
        config_from_dict({**good, "parallel": {**good["parallel"], "ep": 3}})
    with pytest.raises(ValueError, match="unknown precision"):
        config_from_dict({**good, "precision": "fp4"})
    with pytest.raises(ValueError, match="needs a 'hardware'"):
        config_from_dict({k: v for k, v in good.items() if k != "hardware"})
    assert math.isclose(config_from_dict({**good, "precision": "fp8-fp8-fp8fp16"}).precision.optimizer_bytes, 3.0)


@pytest.mark.parametrize("mtbf_s", [600.0, 1800.0])
def test_the_dense_interval_rules_choose_on_the_stall_the_model_charges(mtbf_s):
    """Gemini's interval (the ETTR sweep) is the best fixed interval by the ETTR the simulator then reports,
    CheckFreq's the smallest whose charged overhead is within its cap, and Daly's delta the charged stall at
    interval 1: the trainer's host work included, where the rules once left it out (Gemini then ran at k = 2,
    ETTR 0.921 at a 30 min MTBF, where k = 9 gives 0.947)."""
    cost = CostModel(get_preset("deepseek-moe-16b"))
    assert cost.config.hardware.host_s_per_byte > 0
    gemini = evaluate(cost, parse_policy("gemini"), mtbf_s)
    fixed = [evaluate(cost, parse_policy(f"dense:store=memory:interval={k}:launcher=torchrun"), mtbf_s)
             for k in range(1, 41)]
    assert gemini.ettr == pytest.approx(max(r.ettr for r in fixed), rel=1e-9)
    assert gemini.interval == max(fixed, key=lambda r: r.ettr).interval > 2
    spec = parse_policy("checkfreq")
    k = choose_dense_interval(cost, spec, mtbf_s)
    assert dense_model(cost, spec, k).overhead <= spec.max_overhead < dense_model(cost, spec, k - 1).overhead


def test_selective_on_a_link_too_slow_for_one_expert_saves_one_and_stalls_as_the_runtime_does():
    """The runtime never plans fewer than one expert per iteration (a bandwidth-derived budget is floored at
    the non-experts and one expert: ``SelectivePolicy.observe_iteration_time``), so the model does the same
    and charges the stall, instead of reporting an infinite staleness for a plan the runtime does not run."""
    def result(d2h):
        cfg = tiny(d2h=d2h)
        hw = dataclasses.replace(cfg.hardware, network_bandwidth=1e15, host_s_per_byte=0.0)
        cost = CostModel(dataclasses.replace(cfg, hardware=hw))
        res = evaluate(cost, parse_policy("selective"), 3600.0)
        return res.model, explain(cost, res)

    slow, why = result(1.0)  # 1 B/s: not even the non-expert state fits
    assert slow.knobs["experts_per_iter"] == 1
    assert math.isfinite(slow.lossy_staleness_iters) and slow.stall_s > 0
    assert "1 saved and 1 replicated per iteration (the least the runtime saves; beyond the budget: it stalls)" in why
    fast, why = result(1e12)
    assert fast.knobs["experts_per_iter"] == 4 and fast.stall_s == 0  # every local expert, hidden
    assert "of 4 experts per rank, 4 saved and 4 replicated per iteration within the budgets" in why
