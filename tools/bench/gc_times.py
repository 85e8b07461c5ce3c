"""Python's cyclic garbage collections, timed per iteration (``gc.callbacks``), for the overhead benches.

A collection runs in whichever thread allocates past the thresholds and holds the GIL throughout: a
collection the snapshot threads trigger stops the training thread too. Megatron-LM has ``--manual-gc`` for
that reason (collections at chosen iterations). These counters say whether the snapshots' allocations make
collections more frequent or longer in the iterations that take snapshots
(``tools/bench/gpu_overhead.py``: per kind of interleaved block; ``tools/bench/ckpt_overhead.py``: per
policy).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable

from tools.bench.interleave import by_kind


class GcTimes:
    """Collections in this process by the iteration during which they ran (:attr:`iteration`, set by the
    bench at each step begin): seconds, and full (oldest-generation) collections."""

    def __init__(self) -> None:
        self.iteration = -1
        self.seconds: dict[int, float] = {}
        self.full: dict[int, int] = {}
        self._start = 0.0

    def install(self) -> "GcTimes":
        gc.callbacks.append(self.callback)
        return self

    def remove(self) -> None:
        if self.callback in gc.callbacks:
            gc.callbacks.remove(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        t = self.iteration
        self.seconds[t] = self.seconds.get(t, 0.0) + time.perf_counter() - self._start
        if info["generation"] == 2:
            self.full[t] = self.full.get(t, 0) + 1

    def totals(self, iterations: Iterable[int]) -> tuple[float, int]:
        """Seconds in collections and full collections over ``iterations``."""
        its = list(iterations)
        return sum(self.seconds.get(t, 0.0) for t in its), sum(self.full.get(t, 0) for t in its)


def gc_stats(seconds: dict[int, float], full: dict[int, int], iterations: Iterable[int], block: int) -> dict:
    """Per kind of interleaved block (``"all"`` with ``block`` 0) of ``iterations``: milliseconds in
    collections per iteration and full collections per 100 iterations."""
    return {kind: {"iterations": len(its),
                   "gc_ms_per_iter": 1e3 * sum(seconds.get(t, 0.0) for t in its) / len(its),
                   "full_per_100_iters": 100 * sum(full.get(t, 0) for t in its) / len(its)}
            for kind, its in by_kind(iterations, block).items()}
