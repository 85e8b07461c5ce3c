"""Snapshot overhead measured inside one launch: blocks of ``K`` iterations alternate between snapshots taken
(*active*) and none taken (*paused*), and the ratio of the two blocks' median iteration times is the overhead
(``tools/bench/gpu_overhead.py --interleave K``).

Why: on one H200 two launches of the same ``--ft-policy none`` job differed by 17 % in median iteration time,
ten times the ~1 % the snapshots may cost. Blocks of one launch share the process, its allocator state, its
clocks and its data stream, so what differs between them is the snapshot work alone. A paused iteration takes
no snapshot at all (the runtime gets no session for it: no plan, no metadata capture, no submit, as with
``--ft-policy none``); with ``K`` a multiple of the sparse window every block holds whole windows, so both
kinds of block see every slice of the schedule (MoEvement §3.2: each operator FULL once per window).

The interval of iteration ``t`` (from its start to the next one's) holds the submit of the snapshot of ``t``
and the copy of the snapshot of ``t - 1`` (it overlaps forward/backward of ``t``; the optimizer step of ``t``
waits for it). The first iteration of a block has one and not the other, so it counts for neither kind.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from tools.bench.ratio_ci import cycle_ratio_ci


def snapshots_paused(iteration: int, block: int) -> bool:
    """Whether ``iteration`` lies in a paused block: blocks of ``block`` iterations from iteration 0, the
    first active, then alternating. ``block`` 0: never paused."""
    return block > 0 and (iteration // block) % 2 == 1


def iteration_kind(iteration: int, block: int) -> str | None:
    """``"active"`` when the snapshots of ``iteration - 1`` and ``iteration`` are both taken, ``"paused"``
    when neither is, ``None`` for the first iteration of a block (it holds one and not the other)."""
    paused = snapshots_paused(iteration, block)
    if iteration == 0 or snapshots_paused(iteration - 1, block) != paused:
        return None
    return "paused" if paused else "active"


def by_kind(iterations, block: int) -> dict[str, list[int]]:
    """``iterations``, sorted, grouped by :func:`iteration_kind` (``"all"`` with ``block`` 0); the first
    iteration of a block is in no group."""
    kinds: dict[str, list[int]] = {}
    for t in sorted(iterations):
        kind = iteration_kind(t, block) if block else "all"
        if kind is not None:
            kinds.setdefault(kind, []).append(t)
    return kinds


def interleaved_stats(iteration_s: Mapping[int, float], block: int, *, hook_s: Mapping[int, float] | None = None,
                      snapshot_iterations: frozenset[int] = frozenset()) -> dict:
    """The active/paused comparison of the measured iterations ``iteration_s`` (iteration -> seconds).

    ``active_median_s`` / ``paused_median_s``: medians over the iterations of each kind
    (:func:`iteration_kind`); ``ratio``: their quotient; ``ratio_ci95``: its 95 % bootstrap interval over
    cycles of an active and the next paused block (``None`` with fewer than two); ``blocks`` / ``iterations``: how many of each went
    in; ``block_medians``: ``[first iteration, kind, median s]`` per block, in order (a drift over the launch
    shows there); ``hooks_ms``: median host time in the FT hooks per kind (``hook_s``); ``snapshots``: how
    many of ``snapshot_iterations`` (the iterations whose snapshot was submitted) fall in each kind of block,
    0 for ``paused`` when pausing worked; ``host_s_per_snapshot``: the active median's excess over the paused
    one, the simulator's ``hardware.host_s_per_snapshot`` where every active iteration takes a snapshot (sparse:
    ``moe-ft plan --set hardware.host_s_per_byte=0 --set hardware.host_s_per_snapshot=...``)."""
    by_kind: dict[str, list[int]] = {"active": [], "paused": []}
    for t in sorted(iteration_s):
        kind = iteration_kind(t, block)
        if kind is not None:
            by_kind[kind].append(t)
    if not by_kind["active"] or not by_kind["paused"]:
        raise ValueError(f"interleaved blocks of {block} iterations: the measured iterations "
                         f"{min(iteration_s, default=None)}..{max(iteration_s, default=None)} hold no "
                         f"{'active' if not by_kind['active'] else 'paused'} iteration past a block's first; "
                         "run more iterations or use smaller blocks")
    medians = {kind: statistics.median(iteration_s[t] for t in its) for kind, its in by_kind.items()}
    blocks: dict[int, list[float]] = {}
    for kind, its in by_kind.items():
        for t in its:
            blocks.setdefault(t // block, []).append(iteration_s[t])
    out = {"block": block, "active_median_s": medians["active"], "paused_median_s": medians["paused"],
           "ratio": medians["active"] / medians["paused"],
           "host_s_per_snapshot": max(0.0, medians["active"] - medians["paused"]),
           "ratio_ci95": _ratio_ci(iteration_s, by_kind, block),
           "blocks": {kind: len({t // block for t in its}) for kind, its in by_kind.items()},
           "iterations": {kind: len(its) for kind, its in by_kind.items()},
           "block_medians": [[b * block, "paused" if snapshots_paused(b * block, block) else "active",
                              statistics.median(v)] for b, v in sorted(blocks.items())],
           "snapshots": {"active": sum(not snapshots_paused(t, block) for t in snapshot_iterations),
                         "paused": sum(snapshots_paused(t, block) for t in snapshot_iterations)}}
    if hook_s:
        out["hooks_ms"] = {kind: 1e3 * statistics.median(hook_s[t] for t in its if t in hook_s)
                           for kind, its in by_kind.items() if any(t in hook_s for t in its)}
    return out


def _ratio_ci(iteration_s: Mapping[int, float], kinds: Mapping[str, list[int]], block: int) -> list[float] | None:
    """The 95 % bootstrap interval of the active/paused ratio, a cycle being an active block and the paused block
    after it (``tools/bench/ratio_ci.py``); ``None`` with fewer than two such cycles."""
    by_cycle = {kind: {} for kind in kinds}
    for kind, its in kinds.items():
        for t in its:
            by_cycle[kind].setdefault(t // (2 * block), []).append(iteration_s[t])
    if len(set(by_cycle["active"]) & set(by_cycle["paused"])) < 2:
        return None
    return list(cycle_ratio_ci(by_cycle["active"], by_cycle["paused"]))


def last_snapshot_iterations(*, iters: int, warmup: int, block: int, n: int, what: str) -> list[int]:
    """The last ``n`` iterations past ``warmup`` that take a snapshot (not paused by ``--interleave block``) and
    have a successor (``what``: the option that needs them, for the error)."""
    if n <= 0:
        return []
    taking = [t for t in range(warmup, iters - 1) if not snapshots_paused(t, block)]
    if len(taking) < n:
        raise ValueError(f"{what} needs {n} iterations with snapshots past the warm-up; {len(taking)} in iterations "
                         f"{warmup}..{iters - 2}: run more iterations")
    return taking[-n:]


def profile_iterations(*, iters: int, warmup: int, block: int, n: int) -> tuple[list[int], list[int]]:
    """``(breakdown iterations, profiler iterations)`` of ``--profile-submit n``
    (``tools/bench/submit_profile.py``): the last ``2 n`` iterations past ``warmup`` that take a snapshot and have
    a successor (:func:`last_snapshot_iterations`), the breakdown's first. They come at the end of the run, and
    the timings stop at the first of them: a profiled iteration runs slower, and what the profiler leaves behind
    (CUPTI stays attached) may slow the iterations after it."""
    chosen = last_snapshot_iterations(iters=iters, warmup=warmup, block=block, n=2 * n,
                                      what=f"--profile-submit {n}")
    return chosen[:n], chosen[n:]
