"""How long the GIL is held by other threads, probed from inside the process (``tools/bench/gpu_overhead.py
--gil-probe``).

A daemon thread sleeps 0.5 ms (``--gil-probe SLEEP_S``: any other period) in a loop and measures how late it
wakes up::

    t0 = perf_counter(); time.sleep(0.0005); lag = perf_counter() - t0 - 0.0005

``time.sleep`` releases the GIL and must take it back before it returns, so a lag of L ms means that some other
thread held the GIL for about L ms after the sleep ended (plus the kernel's wake-up latency, some microseconds:
the probe sets its own timer slack to 1 ns where Linux allows it, so the sleep does not overshoot by the
default 50 us). A thread running Python keeps the GIL until the switch interval (``sys.getswitchinterval()``,
5 ms unless ``--switch-interval`` changes it) makes it hand the GIL to a waiter: lags near the switch interval
mean a Python-busy thread; longer ones a C call that keeps the GIL. The lags are attributed to the iteration in
which the probe woke, and summarised per kind of interleaved block (``--interleave``: snapshots taken or paused),
so the background threads' share is the difference between the kinds.

Cost: the probe wakes ~1800 times a second and runs a few microseconds of Python each time (its own CPU is
reported: ``gil_probe_cpu_share`` in ``gpu_overhead.py``'s summary, the fraction of one core: 0.035-0.06 at 0.5 ms). It also takes the GIL from the training
thread more often: whenever the training thread releases the GIL (every torch op does, around its dispatch) while
the probe waits for it, the probe runs first and the training thread waits for it to sleep again. Measured on a
2-core CPU machine (2026-11-27): a thread that only dispatches small torch ops (20k ``add_``) ran 8-11 % slower
with the probe at 0.5 ms, 5-7 % at 1 ms, 3-5 % at 2 ms; the tiny model's interleaved launch (``--tiny --iters 96
--interleave 4 --windows 2``, two launches each) ran 10-13 % slower at 0.5 ms (paused blocks 47.6-48.5 ms ->
53.0-53.9 ms) and 2-5 % at 2 ms, while its taken/paused ratio stayed within the launches' spread (1.19, 1.21
without; 1.17, 1.21 at 0.5 ms; 1.19, 1.20 at 2 ms). So read the ratio with the probe on as a ratio, compare
absolute times only between launches that all have it, and pass a longer sleep (``--gil-probe 0.002``) when the
tax matters more than the resolution.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import sys
import threading
import time
from array import array
from collections.abc import Mapping, Sequence

from tools.bench.interleave import by_kind

SLEEP_S = 0.0005
_PR_SET_TIMERSLACK = 29


def _no_timer_slack() -> None:
    """The calling thread's timer slack at 1 ns (Linux ``prctl``): its sleeps end when asked, not up to 50 us
    later; elsewhere nothing changes (the lags then include the slack)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl: the lags include the default slack
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


class GilProbe:
    """The probe thread (module docstring): :meth:`start`, :meth:`stop`, then :meth:`lags_by_interval`."""

    def __init__(self, sleep_s: float = SLEEP_S) -> None:
        self.sleep_s = sleep_s
        self.wake = array("d")
        """``perf_counter`` at each wake-up."""
        self.lag = array("d")
        """Seconds late at each wake-up."""
        self.cpu_s = 0.0
        """The probe thread's own CPU time (known after :meth:`stop`)."""
        self.wall_s = 0.0
        self._running = False
        self._thread = threading.Thread(target=self._run, name="moe-ft-gil-probe", daemon=True)

    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._thread.join()

    def _run(self) -> None:
        _no_timer_slack()
        wake, lag, clock, sleep, period = self.wake.append, self.lag.append, time.perf_counter, time.sleep, self.sleep_s
        cpu0, start = time.thread_time(), clock()
        while self._running:
            t0 = clock()
            sleep(period)
            t1 = clock()
            wake(t1)
            lag(t1 - t0 - period)
        self.cpu_s, self.wall_s = time.thread_time() - cpu0, clock() - start

    def lags_by_interval(self, starts: Sequence[float]) -> list[list[int]]:
        """The lags in microseconds (rounded) of the wake-ups in each interval ``[starts[i], starts[i + 1])``."""
        out: list[list[int]] = [[] for _ in range(max(0, len(starts) - 1))]
        for t, lag in zip(self.wake, self.lag):
            i = bisect.bisect_right(starts, t) - 1
            if 0 <= i < len(out):
                out[i].append(round(1e6 * lag))
        return out


def _quantile(sorted_us: list[int], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))] / 1e3


def lag_stats(lags_us: Mapping[int, list[int]], block: int) -> dict:
    """Per kind of interleaved block (:func:`tools.bench.interleave.iteration_kind`; ``"all"`` without
    ``--interleave``) of the iterations in ``lags_us`` (iteration -> the probe's lags in that iteration, us):
    ``p50_ms``, ``p99_ms``, ``max_ms`` of the lags; per iteration, how many wake-ups (``samples_per_iter``), their
    summed lag (``total_ms_per_iter``) and the sum of the lags over 0.2 ms (``over_0.2ms_ms_per_iter``: the part a
    kernel wake-up does not explain)."""
    out = {}
    for kind, its in by_kind(lags_us, block).items():
        lags = sorted(v for t in its for v in lags_us[t])
        if not lags:
            continue
        out[kind] = {"iterations": len(its), "samples_per_iter": len(lags) / len(its),
                     "p50_ms": _quantile(lags, 0.5), "p99_ms": _quantile(lags, 0.99), "max_ms": lags[-1] / 1e3,
                     "total_ms_per_iter": sum(lags) / 1e3 / len(its),
                     "over_0.2ms_ms_per_iter": sum(v for v in lags if v > 200) / 1e3 / len(its)}
    return out
