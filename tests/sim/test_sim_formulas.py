"""Formulas pinned on small examples computed by hand."""

import math

import pytest

from moe_ft.sim.analytic import _mean_exp
from moe_ft.sim.costmodel import pipeline_time_s
from moe_ft.sim.formulas import (
    daly_interval_s,
    daly_wall_fraction,
    ettr_first_order,
    ettr_renewal,
    moc_beats_full,
    moc_overhead_per_iter_s,
    moc_total_overhead_s,
    moetion_experts_per_iter,
    moetion_wasted_s,
    snapshot_stall_s,
    young_interval_s,
)


def test_ettr_first_order_hand_example():
    # overhead 1/(10·10) = 1 %, E[R]/MTBF = 60/600 = 10 %
    assert ettr_first_order(1.0, 10.0, 10, 60.0, 600.0) == pytest.approx(1 / 1.01 / 1.1, rel=1e-12)
    assert ettr_first_order(0.0, 10.0, 1, 0.0, 600.0) == 1.0


def test_ettr_renewal_deterministic_recovery():
    # R = 60 s always, MTBF 600 s, 5 % overhead: 1/(1.05·e^0.1)
    assert ettr_renewal(0.05, [60.0], 600.0) == pytest.approx(1 / (1.05 * math.exp(0.1)), rel=1e-12)
    # two equally likely recoveries average their exponentials, not their values
    val = ettr_renewal(0.0, [0.0, 120.0], 600.0)
    assert val == pytest.approx(2 / (1 + math.exp(0.2)), rel=1e-12)
    with pytest.raises(ValueError):
        ettr_renewal(0.0, [], 600.0)


def test_daly_interval_hand_example():
    # δ = 60 s, M = 3600 s: sqrt(2·60·3600) = 657.2671, x = δ/2M = 1/120
    x = 1 / 120
    expected = 657.2670690 * (1 + math.sqrt(x) / 3 + x / 9) - 60
    assert daly_interval_s(60.0, 3600.0) == pytest.approx(expected, rel=1e-9)
    assert daly_interval_s(60.0, 3600.0) == pytest.approx(617.88, abs=0.01)
    assert young_interval_s(60.0, 3600.0) == pytest.approx(657.267, abs=1e-3)
    assert daly_interval_s(8000.0, 3600.0) == 3600.0  # δ >= 2M: checkpoint once per MTBF
    assert daly_interval_s(0.0, 3600.0) == 0.0


def test_daly_interval_maximises_daly_wall_fraction():
    delta, restart, m = 30.0, 120.0, 1800.0
    tau = daly_interval_s(delta, m)
    best = max(range(10, 3000), key=lambda t: daly_wall_fraction(t, delta, restart, m))
    assert abs(best - tau) / tau < 0.02  # Daly's estimate is within 2 % of the true optimum


def test_renewal_model_equals_daly_complete_model():
    # dense checkpointing: compute τ, checkpoint cost δ, restart R0; lost work uniform over τ + δ
    tau, delta, r0, m = 400.0, 20.0, 90.0, 1200.0
    renewal = 1 / ((1 + delta / tau) * _mean_exp([(r0, tau + delta)], m))
    assert renewal == pytest.approx(daly_wall_fraction(tau, delta, r0, m), rel=1e-12)


def test_moc_eq10_stall():
    assert snapshot_stall_s(5.0, 3.0) == 2.0
    assert snapshot_stall_s(2.0, 3.0) == 0.0


def test_moc_eq12_total_overhead_units_fixed():
    # O_save 2 s every 10 of 1000 iterations: 200 s; λ = 0.001/iter → 1 fault: 30 s restart + 5 iters · 5 s
    assert moc_total_overhead_s(2.0, 1000, 10, 0.001, 30.0, 5.0) == pytest.approx(255.0)


def test_moc_eq16_comparison():
    # per iteration: MoC 0.5/1 + 0.001·0.5·5 = 0.5025 ; full 2/10 + 0.001·5·5 = 0.225
    assert moc_overhead_per_iter_s(0.5, 1, 0.001, 5.0) == pytest.approx(0.5025)
    assert moc_overhead_per_iter_s(2.0, 10, 0.001, 5.0) == pytest.approx(0.225)
    assert not moc_beats_full(0.5, 1, 2.0, 10, 0.001, 5.0)
    # with frequent faults (λ = 0.05/iter) the long interval loses: 0.5 + 0.125 < 0.2 + 1.25
    assert moc_beats_full(0.5, 1, 2.0, 10, 0.05, 5.0)


def test_pipeline_1f1b():
    # (M + S - 1) · max t_s = (4 + 3 - 1) · 2
    assert pipeline_time_s(4, [1.0, 2.0, 1.5]) == 12.0
    assert pipeline_time_s(1, [3.0]) == 3.0


def test_moetion_formulas():
    assert moetion_wasted_s(1.0, 2.0, 10, 3.0) == 18.0  # 1 + 2 + 10/2 · 3
    assert moetion_experts_per_iter(10.0, 3.0) == 3
    assert moetion_experts_per_iter(2.0, 3.0) == 0
