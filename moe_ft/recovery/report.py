"""The recovery report: printed in the log (rank 0) and written as JSON."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass(kw_only=True)
class RecoveryReport:
    """What one recovery did."""

    policy: str
    restart_count: int
    failed: dict
    """What failed: the faults whose markers exist (drills), the last iteration completed before the failure."""
    recovery_point: dict
    """``{"start", "end", "source": "memory"|"survivor"|"durable"|"checkpoint"|"initial"}``; ``end`` is the
    restored iteration."""
    replayed_iterations: list[int] = field(default_factory=list)
    reexecuted_iterations: list[int] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    """Seconds per phase: agree, load, replay, finalize, total (the in-job recovery), reexecute (the lost
    iterations run again afterwards) and, in drills, restart (from the fault to the start of recovery) and
    kill_to_resume (from the fault to the moment every rank starts its first resumed iteration); under
    ``moe-ft launch`` also detect (the fault to the agent's notice) and reform (the notice to every rank
    having its new process groups and model)."""
    bytes_loaded: int = 0
    """Bytes read from the store by this rank (rank 0's value in the JSON)."""
    token_loss: dict = field(default_factory=dict)
    """``{"tokens": …, "metric": "PLT"|"MLT"|None, "value": …, "per_layer": …}``; 0 tokens for exact."""
    routing_checked: int = 0
    capacity_boost: dict = field(default_factory=dict)
    """MoEtion §6 boost after a lossy recovery (``--ft-capacity-boost``, ``moe_ft/recovery/boost.py``):
    ``{"boost", "capacity_factor", "started_at", "tokens_to_make_up", "ended_at", "experts": [{"layer",
    "expert", "lost", "carried", "tokens", "made_up_at"}]}``; rewritten as experts make their tokens up.
    Empty without the boost."""
    recovery_levels: dict = field(default_factory=dict)
    """Where each operator's state came from and how exact it is (``moe_ft/recovery/planner.py``):
    ``{"level": the worst level reached (exact | nondeterministic | durable | lossy | approximate |
    start_over), "sources": {source: operators}, "operators": {operator: source}, "path", "planned", "reason",
    "min_level", "unavailable": {source: why}, "rebuilt": [{"rank", "from", "weights", "note"}] (CheckFree)}``."""
    scope: dict = field(default_factory=dict)
    """Which ranks rolled back (``moe_ft/localized/scope.py``, ``moe_ft/recovery/localized.py``): ``{"mode":
    "localized"|"global", "reason", "target", "failed", "replaying", "loading", "failed_stages", "components",
    "replay_from", "why_failed", "replayed": {rank: iterations}, "loaded": [ranks that only loaded their
    survivor point], "log_bytes_read": {rank: bytes}, "bytes_loaded": {rank: bytes}, "seconds": {rank:
    {phase: s}}, "stage_iterations_replayed"}``; a global recovery has mode, reason, target and failed."""
    restart_kind: str = "job"
    """``"inprocess"``: the survivors kept their processes and a spare or fresh process took each failed rank
    (``moe-ft launch``); ``"job"``: every worker was started again (torchrun, or the launcher's fallback)."""
    survivor_pids_kept: bool | None = None
    """In-process attempts: whether every rank not replaced kept its process (same pid before and after)."""
    fallback_reason: str = ""
    """A full restart that ``moe-ft launch`` chose over in-process replacement: why (no spare for a lost
    node's ranks, re-forming the groups exceeded ``--reform-timeout``)."""
    recovered_digest: str = ""
    message: str = ""

    @property
    def timeline_kept_through(self) -> int:
        """The newest iteration whose stored state (snapshot points, replicas, upstream logs) still belongs
        to the job's timeline after this recovery: the one before the resume point, or ``-1`` after a
        CheckFree rebuild. The rebuild replayed the survivors' window with an approximate stage, so their
        points and logs from before it describe a timeline the job left; a later replay that started from
        them would mix the two and call the result exact (CheckFree §4 rebuilds a stage; it keeps no
        point of the old timeline either)."""
        if self.recovery_levels.get("path") == "checkfree":
            return -1
        return int(self.recovery_point["resume"]) - 1

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        rp = self.recovery_point
        secs = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        tl = self.token_loss
        loss = f"{tl.get('tokens', 0):.0f} tokens" + (f" ({tl['metric']} {100 * tl['value']:.3f} %)" if tl.get("metric") else "")
        return (f"moe-ft recovery | policy {self.policy} | restart {self.restart_count} | last completed iteration "
                f"{self.failed.get('last_completed')} | recovery point {rp.get('source')} [{rp.get('start')}, "
                f"{rp.get('end')}] | replayed {len(self.replayed_iterations)} | re-executed "
                f"{len(self.reexecuted_iterations)} | {secs} | token loss {loss} | digest "
                f"{self.recovered_digest[:16]}" + self._scope_summary() + self._levels_summary() + self._boost_summary()
                + (f" | {self.message}" if self.message else ""))

    def _scope_summary(self) -> str:
        sc = self.scope
        if not sc:
            return ""
        if sc.get("mode") != "localized":
            return f" | scope global ({sc.get('reason')})"
        replayed = ", ".join(f"rank {r} {its[0]}-{its[-1]}" if its else f"rank {r} none"
                             for r, its in sc.get("replayed", {}).items())
        return (f" | scope localized: replayed {replayed or 'nothing'}; loaded survivor points {sc.get('loaded')}; "
                f"log bytes read {sum(sc.get('log_bytes_read', {}).values())}")

    def _levels_summary(self) -> str:
        lv = self.recovery_levels
        if not lv:
            return ""
        sources = ", ".join(f"{n} {s}" for s, n in lv.get("sources", {}).items())
        return f" | level {lv.get('level')} ({sources})"

    def _boost_summary(self) -> str:
        cb = self.capacity_boost
        if not cb:
            return ""
        return (f" | capacity boost +{100 * cb['boost']:.0f} % for {len(cb['experts'])} experts, "
                f"{cb['tokens_to_make_up']:.0f} tokens to make up")

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        # the restart count names the file; a second recovery under the same count (a node's agent restarted
        # with a fresh count, or the count stayed on one node) gets a sequence number instead of overwriting
        path = getattr(self, "_written_to", None)  # a report written again (final) replaces its own file
        if path is not None and os.path.dirname(path) == directory:
            return self._write_json(path)
        path = os.path.join(directory, f"recovery_{self.restart_count:03d}.json")
        seq = 0
        while os.path.exists(path):
            seq += 1
            path = os.path.join(directory, f"recovery_{self.restart_count:03d}_{seq}.json")
        self._written_to = path
        return self._write_json(path)

    def _write_json(self, path: str) -> str:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return path
