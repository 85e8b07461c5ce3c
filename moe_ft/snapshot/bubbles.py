"""Bubble-aware snapshot scheduling (MoEtion §5.3, Algorithm 4).

A pipeline stage is idle — neither computing nor communicating — while it waits for its neighbour in the
1F1B (or interleaved) schedule: stage ``i`` waits for its first activation in the warm-up and for gradients
in the cool-down. Algorithm 4 copies as much of the snapshot as fits into that idle time and the rest
alongside computation:

1. ``t_ss = EstimateCheckpointTime(i, W, B_IO)``: the bytes of this snapshot over the copy bandwidth,
   measured on the previous snapshots (:class:`BubbleSchedule` keeps it);
2. ``t_bubble = EstimateBubbleTime(i, C_FB)``: the paper gives the 1F1B estimate
   (:func:`estimate_bubble_time_1f1b`) and, "for other pipeline-parallel configurations, an online bubble
   profiler": we always use the profiler — :class:`BubbleGate` measures the time this stage spent waiting
   in the schedule's p2p exchanges during the previous iteration (it sees the interleaved schedule too);
3. ``t_ss >= t_bubble``: :func:`split_parameters` puts the first ``⌊n·t_bubble/t_ss⌋`` of the vectorised
   snapshot into ``W_bubble`` (copied only while the gate is open) and the rest into ``W*`` (copied at once,
   overlapping computation); otherwise everything is ``W_bubble``.

The copy of snapshot ``t`` must be off the weights before the optimizer step of ``t+1``
(``SnapshotEngine.wait_copied``); whatever of ``W_bubble`` the bubbles of iteration ``t+1`` did not absorb
is copied then ("forced"), so the schedule never changes what a snapshot holds, only when its bytes move.

Where it applies: the CPU snapshot engine, whose copy thread competes with the training thread for cores and
memory bandwidth. On a GPU the copy is a DMA on a side stream issued at ``submit`` and the host does not
block in NCCL p2p calls (they are enqueued), so host-side bubble detection cannot see device bubbles; the
CUDA path keeps issuing the whole copy at ``submit`` (docs/snapshot.md).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence


def check_pipeline(pipeline_size: int) -> None:
    """Bubble-aware snapshots need a pipeline: with one stage no rank ever waits for a neighbour."""
    if pipeline_size < 2:
        raise ValueError(f"--ft-snapshot-bubble-aware schedules snapshot copies into pipeline bubbles; this job has "
                         f"--pipeline-model-parallel-size {pipeline_size} (no bubbles): drop the flag or use PP > 1")


def estimate_bubble_time_1f1b(*, pp_size: int, t_fwd_s: float, t_bwd_s: float) -> float:
    """Idle seconds of one stage per 1F1B iteration with uniform per-micro-batch times (Alg. 4,
    ``EstimateBubbleTime``): the iteration lasts ``(m + p - 1)(t_f + t_b)`` and every stage computes
    ``m (t_f + t_b)`` of it, so each stage idles ``(p - 1)(t_f + t_b)`` — stage ``i`` ``i·t_f`` before
    its first forward and the rest in the cool-down and between its backward passes."""
    if pp_size < 1 or t_fwd_s < 0 or t_bwd_s < 0:
        raise ValueError("pp_size must be >= 1 and the micro-batch times >= 0")
    return (pp_size - 1) * (t_fwd_s + t_bwd_s)


def split_parameters(sizes: Sequence[int], t_ss: float, t_bubble: float) -> int:
    """Alg. 4 ``SplitParameter`` at entry granularity: the number of leading entries (of byte ``sizes``, in
    snapshot order) that make ``W_bubble``: as many as fit in the first ``⌊n·t_bubble/t_ss⌋`` bytes (all
    of them when ``t_ss < t_bubble``; none without any bubble)."""
    if t_ss < t_bubble:
        return len(sizes)
    if t_bubble <= 0 or t_ss <= 0:
        return 0
    room = int(sum(sizes) * t_bubble / t_ss)
    count = used = 0
    for size in sizes:
        if used + size > room:
            break
        used += size
        count += 1
    return count


class BubbleGate:
    """Open while the training thread waits in a pipeline p2p exchange (the stage is idle): the online
    bubble profiler of MoEtion §5.3. The schedule seam calls :meth:`enter`/:meth:`leave` around each
    exchange; the snapshot engine's thread waits on it. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, keep_intervals: bool = False) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._open_since: float | None = None
        self._idle_s = 0.0
        self.keep_intervals = keep_intervals
        self.intervals: list[tuple[float, float]] = []
        """Closed idle intervals ``(start, end)`` (only with ``keep_intervals``: the trace of a drill)."""

    @property
    def is_open(self) -> bool:
        return self._open_since is not None

    def enter(self) -> None:
        with self._cond:
            if self._open_since is None:
                self._open_since = self._clock()
            self._cond.notify_all()

    def leave(self) -> None:
        with self._cond:
            if self._open_since is None:
                return
            end = self._clock()
            self._idle_s += end - self._open_since
            if self.keep_intervals:
                self.intervals.append((self._open_since, end))
            self._open_since = None

    def take_idle(self) -> float:
        """Idle seconds measured since the previous call (the bubble time of the iteration that ended)."""
        with self._cond:
            idle, self._idle_s = self._idle_s, 0.0
            if self._open_since is not None:  # an exchange in progress: count its part so far
                now = self._clock()
                idle += now - self._open_since
                self._idle_s = -(now - self._open_since)
            return idle

    def wait_open(self, give_up: threading.Event, poll_s: float = 0.05) -> bool:
        """Block until the gate is open (``True``) or ``give_up`` is set (``False``: the deadline, copy
        now). ``poke`` wakes the waiter when ``give_up`` is set."""
        with self._cond:
            while self._open_since is None:
                if give_up.is_set():
                    return False
                self._cond.wait(poll_s)
            return True

    def poke(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class BubbleSchedule:
    """Per-rank state of Algorithm 4: the gate (profiled bubble time) and the measured copy bandwidth."""

    gate: BubbleGate
    bandwidth: float | None = None
    """``B_IO`` in bytes/s: measured on the copies so far (``None`` until the first)."""
    t_bubble_s: float = 0.0
    """Idle time of the newest finished iteration (the profiler's estimate for the next one)."""
    trace: list | None = None
    """With a list: one ``{"iteration", "op", "kind", "start", "end", "bytes"}`` per copied entry
    (``kind`` ``"compute"``: W*, ``"bubble"``: copied while the gate was open, ``"forced"``: at the deadline)."""

    def end_iteration(self) -> float:
        """Called once per iteration by the training thread: the profiled bubble time becomes the estimate."""
        self.t_bubble_s = self.gate.take_idle()
        return self.t_bubble_s

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            bw = nbytes / seconds
            self.bandwidth = bw if self.bandwidth is None else 0.5 * (self.bandwidth + bw)

    def split(self, sizes: Sequence[int]) -> int:
        """How many leading entries go to ``W_bubble`` (Alg. 4 lines 1-7)."""
        if self.bandwidth is None:  # no measurement yet: everything alongside computation
            return 0
        t_ss = sum(sizes) / self.bandwidth
        return split_parameters(sizes, t_ss, self.t_bubble_s)

    def record(self, **piece) -> None:
        if self.trace is not None:
            self.trace.append(piece)
