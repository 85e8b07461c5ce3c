"""Expert loads measured by the popularity counters of an earlier run (``--ft-expert-loads-from``).

Lazarus §4.1 allocates replicas from the expert load distribution the agent collects from the routers'
history ("routing history of gate networks", §3). Our routers count tokens per (MoE layer, expert) in
``moe_ft/popularity.py``; with ``--ft-trace-out`` rank 0 appends one JSON line per iteration::
    {"iteration": 12, "replay": false, "counts": [[t_00, t_01, ...], ...], "full_experts": [...]}

``counts[l][e]``: tokens routed to expert ``e`` of MoE layer ``l`` in that iteration (hard counts, summed over
every rank whatever the policy: ``--ft-trace-out`` makes the runtime sum the popularity counters,
``FTConfig.needs_popularity``).
``read_trace_loads`` sums them per layer: one load vector per MoE layer, so every layer gets its own
allocation and plan (§4.1, last paragraph).

Which lines count: replayed iterations (``"replay": true``, re-executed after a recovery) are skipped, as
their tokens were already counted once; when the same iteration appears more than once (a resumed run
appending to the same file) the last line wins, as it describes the training that stands. ``window``
keeps only the newest iterations (the load of the recent past, for drifting routers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredLoads:
    """Tokens per expert summed over the selected iterations of a trace."""

    counts: tuple[tuple[float, ...], ...]
    """``counts[l][e]``: tokens of expert ``e`` in MoE layer ``l`` (``[num_layers][num_experts]``)."""
    iterations: tuple[int, ...]
    """The iterations summed, ascending."""
    source: str
    """The file they were read from."""

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    def check_model(self, num_layers: int, num_experts: int) -> None:
        """``ValueError`` unless the trace describes a model with ``num_layers`` MoE layers x ``num_experts``."""
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise ValueError(
                f"{self.source} counts {self.num_layers} MoE layers x {self.num_experts} experts but this model "
                f"has {num_layers} x {num_experts}; use a trace of a run of the same model (--num-layers, "
                f"--num-experts) or pass --ft-expert-loads")

    def layer(self, layer_idx: int) -> list[float]:
        """Loads of MoE layer ``layer_idx`` (0-based, Megatron's ``layer_number - 1``)."""
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"{self.source} has loads for MoE layers 0..{self.num_layers - 1}, not layer "
                             f"{layer_idx}")
        return list(self.counts[layer_idx])


def _parse_line(text: str, where: str) -> dict:
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}); is this an --ft-trace-out file?") from None
    if not isinstance(line, dict) or "iteration" not in line or "counts" not in line:
        raise ValueError(f"{where}: expected an --ft-trace-out line with 'iteration' and 'counts'")
    if not isinstance(line["iteration"], int) or isinstance(line["iteration"], bool):
        raise ValueError(f"{where}: 'iteration' must be an integer, got {line['iteration']!r}")
    counts = line["counts"]
    if (not isinstance(counts, list) or not counts
            or not all(isinstance(row, list) and row for row in counts)):
        raise ValueError(f"{where}: 'counts' must be a non-empty [layer][expert] list of lists")
    for row in counts:
        for c in row:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
                raise ValueError(f"{where}: token counts must be finite non-negative numbers, got {c!r}")
    return line


def read_trace_loads(path: str, window: int = 0) -> MeasuredLoads:
    """Per-layer expert loads from an ``--ft-trace-out`` file (see the module docstring).

    ``window``: keep the newest ``window`` iterations (0: all). Raises ``ValueError`` for a missing, empty
    or corrupt file and for lines of different shapes.
    """
    if window < 0:
        raise ValueError(f"the loads window must be >= 0 iterations (0 = all), got {window}")
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ValueError(f"cannot read the expert loads trace {path}: {e.strerror}; write one with "
                         f"--ft-trace-out in an earlier run") from None
    by_iteration: dict[int, list[list[float]]] = {}
    shape = None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        line = _parse_line(text, where)
        counts = line["counts"]
        widths = {len(row) for row in counts}
        if len(widths) != 1:
            raise ValueError(f"{where}: layers have different numbers of experts {sorted(widths)}")
        line_shape = (len(counts), len(counts[0]))
        if shape is None:
            shape = line_shape
        elif line_shape != shape:
            raise ValueError(f"{where}: counts are {line_shape[0]} layers x {line_shape[1]} experts but earlier "
                             f"lines have {shape[0]} x {shape[1]}; the file mixes runs of different models")
        if line.get("replay", False):
            continue  # re-executed after a recovery: these tokens were counted when first trained
        by_iteration[line["iteration"]] = counts
    if not by_iteration:
        raise ValueError(f"{path} holds no trained iteration (empty, or only replays); run with --ft-trace-out "
                         f"{path} for a few iterations first")
    iterations = sorted(by_iteration)[-window:] if window else sorted(by_iteration)
    assert shape is not None  # set by every trained iteration's line
    num_layers, num_experts = shape
    totals = [[0.0] * num_experts for _ in range(num_layers)]
    for it in iterations:  # ascending: the same float sum on every rank and every read
        for layer_idx, row in enumerate(by_iteration[it]):
            for expert_idx, c in enumerate(row):
                totals[layer_idx][expert_idx] += float(c)
    return MeasuredLoads(counts=tuple(tuple(row) for row in totals), iterations=tuple(iterations), source=path)
