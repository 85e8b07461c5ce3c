"""Failure processes for the simulator: seeded Poisson, spot-instance preemptions, or a trace file.

A failure event is ``(time_s, nodes)``; several nodes in one event fail together (concurrent failures,
MoEvement App. A). Trace files are CSV with a header ``time_s,nodes`` and one row per event; ``nodes``
lists node indices separated by ``;`` (``120.5,3`` or ``3600,4;5``). Rows need not be sorted.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass

import numpy as np

MAX_EVENTS = 1_000_000
"""The most failures (Poisson) or node-hours (spot) one simulated run draws: beyond it the arrays alone take
gigabytes, and a job failing that often makes no progress to model."""


@dataclass(frozen=True)
class FailureEvent:
    time_s: float
    nodes: tuple[int, ...]


def poisson_failures(mtbf_s: float, horizon_s: float, num_nodes: int, seed: int) -> list[FailureEvent]:
    """Job-level Poisson failures with rate ``1/MTBF``, each on one uniformly chosen node."""
    if mtbf_s <= 0 or horizon_s <= 0 or num_nodes < 1:
        raise ValueError("mtbf_s and horizon_s must be > 0 and num_nodes >= 1")
    expected = horizon_s / mtbf_s
    if not math.isfinite(expected) or expected > MAX_EVENTS:
        raise ValueError(f"{expected:.3g} failures expected in {horizon_s:g} s at an MTBF of {mtbf_s:g} s; at most "
                         f"{MAX_EVENTS} are simulated: raise the MTBF or shorten the run (--hours)")
    rng = np.random.default_rng(seed)
    n = int(expected + 10 * math.sqrt(expected) + 10)
    times = np.cumsum(rng.exponential(mtbf_s, size=n))
    while times[-1] < horizon_s:  # extremely unlikely; extend rather than truncate the process
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(mtbf_s, size=n))])
    times = times[times < horizon_s]
    nodes = rng.integers(0, num_nodes, size=len(times))
    return [FailureEvent(float(t), (int(k),)) for t, k in zip(times, nodes)]


def spot_failures(preempt_prob_per_hour: float, horizon_s: float, num_nodes: int, seed: int) -> list[FailureEvent]:
    """Spot-instance preemptions as in Lazarus §6.7 (after Bamboo): each node is preempted in each hour
    with a constant probability, at a uniform time within that hour; a spare replaces it at once.
    Preemptions of several nodes within one second are merged into one concurrent event."""
    if not 0 <= preempt_prob_per_hour <= 1:
        raise ValueError("preempt_prob_per_hour must be in [0, 1]")
    if not math.isfinite(horizon_s) or horizon_s / 3600 * num_nodes > MAX_EVENTS:
        raise ValueError(f"a run of {horizon_s / 3600:g} h on {num_nodes} nodes draws more than {MAX_EVENTS} "
                         "node-hours of spot preemptions: shorten the run (--hours)")
    rng = np.random.default_rng(seed)
    hours = math.ceil(horizon_s / 3600)
    hit = rng.random((hours, num_nodes)) < preempt_prob_per_hour
    hour_idx, node_idx = np.nonzero(hit)
    times = (hour_idx + rng.random(len(hour_idx))) * 3600.0
    order = np.argsort(times, kind="stable")
    events: list[FailureEvent] = []
    for t, node in zip(times[order], node_idx[order]):
        if t >= horizon_s:
            continue
        if events and t - events[-1].time_s < 1.0:
            events[-1] = FailureEvent(events[-1].time_s, events[-1].nodes + (int(node),))
        else:
            events.append(FailureEvent(float(t), (int(node),)))
    return events


def load_trace(path: str, num_nodes: int) -> list[FailureEvent]:
    """Read a failure trace CSV (format in the module docstring); node indices must be < ``num_nodes``."""
    events = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not {"time_s", "nodes"} <= set(reader.fieldnames):
                raise ValueError(f"trace {path!r} needs a header 'time_s,nodes', got {reader.fieldnames}")
            for line, row in enumerate(reader, start=2):
                try:
                    t = float(row["time_s"])
                    nodes = tuple(int(x) for x in row["nodes"].split(";") if x.strip())
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{line}: expected 'seconds,node[;node...]', got {row}") from None
                if t < 0 or not nodes or any(not 0 <= k < num_nodes for k in nodes):
                    raise ValueError(f"{path}:{line}: time must be >= 0 and nodes in [0, {num_nodes})")
                events.append(FailureEvent(t, nodes))
    except OSError as exc:
        raise ValueError(f"cannot read trace {path!r}: {exc.strerror}") from None
    return sorted(events, key=lambda e: e.time_s)
