"""Which ranks roll back after a failure (MoEvement §3.4 and App. A): the *scope* of a recovery.

A pure decision over what every rank reports after the restart (:class:`RankReport`, gathered on the host
path by the driver, ``moe_ft/recovery/driver.py``), so that every rank computes the same answer:

* the *target* is the newest iteration any rank published a survivor point for (the job's newest completed
  iteration, ``moe_ft/localized/survivor.py``);
* a rank is *failed* when it has no usable survivor point at the target (killed, dump unfinished or
  corrupt, stopped inside an optimizer step, or a point older than the target);
* the *replaying set* is every rank of the failed ranks' pipeline stages (the stage's data-, expert- and
  tensor-parallel peers: they exchange activations and gradients inside the stage, so they replay together);
  every other rank *loads* its survivor point and does not replay;
* failed stages that are adjacent in the pipeline form one *component* and recover jointly, fed by the
  logs of the component's boundary neighbours; non-adjacent components recover independently (App. A);
* the replaying ranks restore their sparse window ``[start, end]`` and replay ``start+1 … target`` from the
  neighbours' logs, so those logs must cover that range.

It falls back to the global replay of today (every rank restores its window and replays the full
pipeline) with the reason in the report when: localized recovery is off (``--ft-recovery-scope global``),
there is no pipeline parallelism, no rank published a survivor point, every stage lost a rank, a replaying
rank has no recovery point of its own, or a neighbour's logs do not cover the replay. A failure *during* a
recovery restarts the job again; ranks that died then have no survivor point and join the failed set: the
scope widens by itself (cascading failures, App. A).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RankReport:
    """What one rank can contribute to a localized recovery."""

    rank: int
    pp_rank: int
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, in stage order."""
    survivor: int
    """Iteration of this rank's verified survivor point, ``-1``: none."""
    survivor_why_not: str = ""
    window: tuple[int, int] | None = None
    """``(start, end)`` of the newest recovery point in this rank's own memory tier (``None``: none)."""
    logged: tuple[int, int] | None = None
    """``(first, last)`` iterations this rank's upstream log holds without gaps (``None``: none)."""


@dataclass
class Scope:
    """The decision (the same on every rank)."""

    mode: str
    """``localized`` or ``global``."""
    reason: str
    target: int = -1
    """The iteration every rank holds after the recovery (localized); training resumes at ``target + 1``."""
    failed: list[int] = field(default_factory=list)
    """Ranks without a usable survivor point at ``target``."""
    replaying: list[int] = field(default_factory=list)
    loading: list[int] = field(default_factory=list)
    """Ranks that load their survivor point and do not replay."""
    failed_stages: list[int] = field(default_factory=list)
    components: list[list[int]] = field(default_factory=list)
    """Runs of adjacent failed stages (each recovers jointly; runs recover independently)."""
    replay_from: int = -1
    """The earliest iteration a replaying rank re-runs (its window start + 1): the logs must reach back to it."""
    why_failed: dict[int, str] = field(default_factory=dict)
    rewrote_state: bool = False
    """The localized attempt began to load survivor points or replay into the live state: where it then failed,
    only a recovery that restores every operator makes the state whole again."""

    def to_json(self) -> dict:
        return {**asdict(self), "why_failed": {str(k): v for k, v in self.why_failed.items()}}

    @property
    def localized(self) -> bool:
        return self.mode == "localized"


def components_of(stages: Sequence[int]) -> list[list[int]]:
    """Runs of consecutive stage indices: ``[1, 2, 4]`` → ``[[1, 2], [4]]``."""
    out: list[list[int]] = []
    for s in sorted(set(stages)):
        if out and out[-1][-1] == s - 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def decide_scope(reports: Sequence[RankReport], *, requested: str = "localized") -> Scope:
    """The recovery scope from every rank's :class:`RankReport` (pure; see the module docstring)."""
    if requested == "global":
        return Scope("global", "--ft-recovery-scope global")
    by_rank = {r.rank: r for r in reports}
    num_stages = max(len(r.pp_ranks) for r in reports)
    if num_stages < 2:
        return Scope("global", "no pipeline parallelism: every rank is in the failed stage")
    target = max(r.survivor for r in reports)
    if target < 0:
        whys = sorted({r.survivor_why_not for r in reports if r.survivor_why_not})
        return Scope("global", "no rank published a survivor point" + (f" ({'; '.join(whys)})" if whys else ""))
    why_failed = {}
    for r in reports:
        if r.survivor != target:
            why_failed[r.rank] = (r.survivor_why_not or "no survivor point") if r.survivor < 0 else \
                f"its survivor point is at iteration {r.survivor}, older than the job's newest completed {target}"
    failed_stages = sorted({by_rank[r].pp_rank for r in why_failed})
    if not failed_stages:
        return Scope("localized", f"every rank published its state at iteration {target}: nothing to replay",
                     target=target, loading=sorted(by_rank))
    if len(failed_stages) == num_stages:
        return Scope("global", f"every pipeline stage lost a rank ({_describe(why_failed)}): nothing to localize",
                     target=target, failed=sorted(why_failed), why_failed=why_failed)
    replaying = sorted(r.rank for r in reports if r.pp_rank in failed_stages)
    loading = sorted(set(by_rank) - set(replaying))
    base = dict(target=target, failed=sorted(why_failed), replaying=replaying, loading=loading,
                failed_stages=failed_stages, components=components_of(failed_stages), why_failed=why_failed)
    no_window = [r for r in replaying if by_rank[r].window is None or by_rank[r].window[1] > target]
    if no_window:
        return Scope("global", f"replaying rank(s) {no_window} have no recovery point of their own at or before "
                               f"iteration {target}", **base)
    replay_from = min(by_rank[r].window[0] for r in replaying) + 1
    base["replay_from"] = replay_from
    if replay_from <= target:
        for r in replaying:  # every neighbour that does not replay must have logged the replayed iterations
            rep = by_rank[r]
            for nb in (rep.pp_rank - 1, rep.pp_rank + 1):
                if not 0 <= nb < len(rep.pp_ranks) or rep.pp_ranks[nb] in replaying:
                    continue
                logged = by_rank[rep.pp_ranks[nb]].logged
                if logged is None or logged[0] > replay_from or logged[1] < target:
                    have = f"[{logged[0]}, {logged[1]}]" if logged else "nothing"
                    return Scope("global", f"rank {rep.pp_ranks[nb]} (stage {nb}) logged {have} but replaying "
                                           f"stage {rep.pp_rank} needs iterations [{replay_from}, {target}]", **base)
    return Scope("localized", f"{_describe(why_failed)}; stage(s) {failed_stages} replay iterations "
                              f"[{replay_from}, {target}] from their neighbours' logs, ranks {loading} load their "
                              f"survivor points", **base)


def _describe(why_failed: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {w}" for r, w in sorted(why_failed.items()))
