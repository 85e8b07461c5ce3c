"""How far a measured overhead ratio can be trusted: a bootstrap confidence interval that resamples whole cycles.

The overhead benchmarks interleave what they compare inside one job (``ckpt_overhead.py``: one block of
iterations per policy per cycle; ``gpu_overhead.py --interleave``: an active block, then a paused one) and
report the ratio of two medians. Iterations are not independent samples: the machine's load drifts over a run,
and the blocks of one cycle share it. So the interval resamples *cycles*, with replacement, keeping each
cycle's blocks of both sides together (the pairing that the interleaving bought), and recomputes the ratio of
medians on every resample; the percentile interval of those ratios is returned (Efron and Tibshirani, *An
Introduction to the Bootstrap*, 1993, ch. 13, percentile intervals; the block bootstrap for dependent data:
Künsch, *The Jackknife and the Bootstrap for General Stationary Observations*, Annals of Statistics 17(3),
1989).

With few cycles the interval is coarse (three cycles allow only ten distinct resamples): it then says that the
run cannot tell, which is its purpose. A claim such as "cpu_ratio <= 1.02" holds when the upper end does.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence

RESAMPLES = 2000


def cycle_ratio_ci(treated: Mapping[int, Sequence[float]], baseline: Mapping[int, Sequence[float]], *,
                   level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``median(treated) / median(baseline)``.

    ``treated`` and ``baseline`` map a cycle to the values measured in it (one block's iterations each); only
    cycles present in both are used, and a resample draws that many cycles with replacement, taking both sides'
    values of each drawn cycle. Deterministic for a given ``seed``."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie strictly between 0 and 1, got {level}")
    cycles = sorted(c for c in set(treated) & set(baseline) if treated[c] and baseline[c])
    if len(cycles) < 2:
        raise ValueError(f"a confidence interval needs at least 2 cycles measured on both sides, got {len(cycles)}: "
                         "run more cycles")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = [cycles[rng.randrange(len(cycles))] for _ in cycles]
        a = statistics.median(x for c in drawn for x in treated[c])
        b = statistics.median(x for c in drawn for x in baseline[c])
        ratios.append(a / b)
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1 - tail) * resamples))]
