"""The bootstrap interval of the overhead benchmarks (``tools/bench/ratio_ci.py``): it resamples whole cycles,
keeping both sides of a cycle together."""

from __future__ import annotations

import random
import statistics

import pytest

from tools.bench.interleave import interleaved_stats, snapshots_paused
from tools.bench.ratio_ci import cycle_ratio_ci


def _cycles(n: int, per: int, ratio: float, *, drift: float, noise: float, seed: int):
    """``n`` cycles of ``per`` values a side: both sides share the cycle's load factor (up to ``drift``), each value
    its own noise (up to ``noise``); the treated side costs ``ratio`` times the baseline."""
    rng = random.Random(seed)
    treated, baseline = {}, {}
    for c in range(n):
        load = 1 + rng.uniform(0, drift)
        baseline[c] = [load * (1 + rng.uniform(-noise, noise)) for _ in range(per)]
        treated[c] = [ratio * load * (1 + rng.uniform(-noise, noise)) for _ in range(per)]
    return treated, baseline


def test_the_interval_holds_the_true_ratio_and_excludes_one_when_the_effect_is_clear():
    treated, baseline = _cycles(12, 4, 1.05, drift=0.02, noise=0.005, seed=1)
    lo, hi = cycle_ratio_ci(treated, baseline)
    point = statistics.median(x for v in treated.values() for x in v) / statistics.median(
        x for v in baseline.values() for x in v)
    assert lo <= point <= hi
    assert 1.0 < lo < 1.05 < hi < 1.1


def test_cycles_are_resampled_with_both_sides_together():
    # the machine's load moves the cycles by up to 30 %, a hundred times the within-cycle noise: paired, the
    # interval stays near the true 1.02; resampling the two sides' cycles independently would span ~0.8-1.3
    treated, baseline = _cycles(10, 4, 1.02, drift=0.3, noise=0.001, seed=2)
    lo, hi = cycle_ratio_ci(treated, baseline)
    assert 0.99 < lo <= 1.02 <= hi < 1.05
    assert cycle_ratio_ci(treated, baseline) == (lo, hi)  # deterministic for a seed


def test_constant_values_give_a_point_and_noise_widens_the_interval():
    assert cycle_ratio_ci({0: [2.0, 2.0], 1: [2.0]}, {0: [1.0], 1: [1.0, 1.0]}) == (2.0, 2.0)
    narrow = cycle_ratio_ci(*_cycles(8, 4, 1.0, drift=0.0, noise=0.01, seed=3))
    wide = cycle_ratio_ci(*_cycles(8, 4, 1.0, drift=0.0, noise=0.1, seed=3))
    assert wide[1] - wide[0] > 3 * (narrow[1] - narrow[0]) > 0


def test_too_few_cycles_or_a_bad_level_is_refused():
    with pytest.raises(ValueError, match="at least 2 cycles"):
        cycle_ratio_ci({0: [1.0], 1: [1.0]}, {0: [1.0], 2: [1.0]})  # one cycle on both sides
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        cycle_ratio_ci({0: [1.0], 1: [1.0]}, {0: [1.0], 1: [1.0]}, level=1.0)


def test_interleaved_stats_pair_each_active_block_with_the_paused_block_after_it():
    block, rng = 4, random.Random(4)
    times = {}
    for t in range(1, 8 * block * 2):
        load = 1 + 0.2 * ((t // (2 * block)) % 3)  # drifts by cycle, not within one
        times[t] = load * (1.03 if not snapshots_paused(t, block) else 1.0) * (1 + rng.uniform(-0.002, 0.002))
    lo, hi = interleaved_stats(times, block)["ratio_ci95"]
    assert 1.0 < lo <= 1.03 <= hi < 1.06
    assert interleaved_stats({t: 1.0 for t in range(1, 2 * block)}, block)["ratio_ci95"] is None  # one cycle
