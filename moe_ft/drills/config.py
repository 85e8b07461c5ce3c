"""The failure drills' flags (``--ft-fail``, ``--ft-fail-marker-dir``, ``--ft-digest-out``, ``--ft-trace-out``) and
their build: the fault plan (``moe_ft/drills/faults.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron.training.argument_utils import field_help
from moe_ft.drills.faults import KINDS, PHASES, Fault, FaultPlan, FaultPlanConfig


@dataclass(kw_only=True)
class DrillConfig:
    """Failure drills: injected faults and the files drills compare (``moe_ft/drills/faults.py``, ``moe-ft drill``)."""

    fail: list[str] = field(default_factory=list, metadata=field_help(
        f"Failure drill: inject faults RANK:ITER[:PHASE[:KIND]] (PHASE {'|'.join(PHASES)}, KIND {'|'.join(KINDS)}); "
        "each fires once across restarts (moe_ft/drills/faults.py)."))
    fail_marker_dir: str = field(default="", metadata=field_help(
        "Directory of the faults' once-only markers (default: faults/ in the node store's job directory). "
        "Drills on several simulated nodes share one: a rank that a spare on another node took over finds its "
        "fault fired."))
    digest_out: str = field(default="", metadata=field_help(
        "Write the final training-state digest (moe-ft digest) as JSON to this file at the end of training."))
    trace_out: str = field(default="", metadata=field_help(
        "Rank 0 appends one JSON line per trained iteration (not replays) to this file: the world-summed "
        "per-expert token counts and the experts the plan saved FULL (drills recompute PLT/MLT from it)."))

    def __post_init__(self) -> None:
        for text in self.fail:
            Fault.parse(text)  # raises ValueError naming the bad fault

    def build(self, job_dir: str):
        """The fault plan (fired markers under ``--ft-fail-marker-dir`` or ``job_dir/faults``: each fault fires
        once across restarts)."""

        marker_dir = self.fail_marker_dir or os.path.join(job_dir, "faults")
        return FaultPlan.from_config(FaultPlanConfig(faults=list(self.fail), marker_dir=marker_dir))
