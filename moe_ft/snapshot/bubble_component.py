"""The runtime side of bubble-aware snapshots (MoEtion §5.3, Alg. 4; ``moe_ft/snapshot/bubbles.py``): tells
the engine's :class:`BubbleGate` when this stage waits in a pipeline exchange, reports the profiled bubble
time and the share of the snapshot copied in bubbles on the FT log line, and writes the schedule trace
(``--ft-trace-out``: ``<trace>.bubbles.rank<r>.jsonl``, one line per iteration: the idle intervals and the
copied pieces), which shows where the copies landed."""

from __future__ import annotations

import json

from moe_ft.localized.upstream_log import P2PSeam
from moe_ft.runtime.components import Component
from moe_ft.snapshot.bubbles import check_pipeline


class BubbleScheduling(Component):
    """Attaches the session engine's gate to the p2p seam of Megatron's schedules (shared with upstream
    logging when that is on)."""

    def __init__(self, schedule, seam, *, owns_seam: bool, trace_path: str | None = None) -> None:
        self.schedule, self.seam, self.owns_seam = schedule, seam, owns_seam
        self.trace_path = trace_path
        self.last: dict = {}
        seam.idle_gates.append(schedule.gate)

    @classmethod
    def build(cls, session, *, pipeline_size: int, trace_out: str = "", rank: int = 0) -> "BubbleScheduling":
        schedule = session.engine.config.bubbles
        check_pipeline(pipeline_size)  # refused at parsing (SnapshotConfig.check_args); built directly too
        if session.engine.cuda:
            raise ValueError("--ft-snapshot-bubble-aware applies to the CPU snapshot engine; on CUDA the copy is a "
                             "side-stream DMA issued at submit (docs/snapshot.md): drop the flag")
        seam = P2PSeam.current()
        owns = seam is None
        if owns:
            seam = P2PSeam().install()
        trace = f"{trace_out}.bubbles.rank{rank}.jsonl" if trace_out else None
        return cls(schedule, seam, owns_seam=owns, trace_path=trace)

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        # pieces of older snapshots (copied during this iteration's bubbles) and the idle intervals so far
        pieces, self.schedule.trace[:] = list(self.schedule.trace), []
        intervals, self.schedule.gate.intervals[:] = list(self.schedule.gate.intervals), []
        copied = sum(p["bytes"] for p in pieces)
        in_bubbles = sum(p["bytes"] for p in pieces if p["kind"] == "bubble")
        self.last = {"bubble_ms": 1e3 * self.schedule.t_bubble_s,
                     "bubble_copied": in_bubbles / copied if copied else 0.0}
        if self.trace_path:
            with open(self.trace_path, "a") as f:
                f.write(json.dumps({"iteration": iteration, "replay": replaying, "idle": intervals,
                                    "pieces": pieces}) + "\n")

    def metrics(self, record) -> dict:
        return dict(self.last)

    def close(self) -> None:
        if self.schedule.gate in self.seam.idle_gates:
            self.seam.idle_gates.remove(self.schedule.gate)
        if self.owns_seam:
            self.seam.uninstall()
