"""Schedule arithmetic of sparse checkpointing (MoEvement §3.2, §3.5, Alg. 1, App. B): operator order,
per-device slicing of a window, and the reorder rule. Pure functions; the policy object is ``sparse.py``.

Slicing is per device (rank key, see ``base.py``): each device copies its own operators over its own
host link, so the global order is restricted to each device's operators and cut into ``a_r`` operators
per iteration (``GenerateSchedule``, Alg. 1 lines 19-29, run per device). All devices share one window
length ``W`` so that a window is a recovery point for the whole job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from moe_ft.policy.base import RankKey, rank_key
from moe_ft.policy.window import find_window_size, window_peak_bytes
from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan

ORDERS = {"popularity": "hard", "soft": "soft", "ema": "ema", "capacity": "hard"}
"""Ordering scheme (MoEvement §3.5, App. B) → popularity counter it reads."""


@dataclass(frozen=True)
class SparseWindow:
    """One sparse checkpointing window: iterations ``[start, start + length)``. ``order``: operators in
    checkpoint order (ascending popularity, non-experts last); ``slice_of[op]``: offset in the window of the
    iteration after which ``op`` is FULL. Before that it is COMPUTE, after it NONE."""

    start: int
    length: int
    order: tuple[OperatorId, ...]
    slice_of: Mapping[OperatorId, int]

    @property
    def end(self) -> int:
        return self.start + self.length

    def contains(self, iteration: int) -> bool:
        return self.start <= iteration < self.end

    def activation_iteration(self, op: OperatorId) -> int:
        """The iteration whose snapshot holds ``op`` FULL (where recovery activates it, MoEvement §3.3)."""
        return self.start + self.slice_of[op]

    def activation_schedule(self) -> Mapping[OperatorId, int]:
        return MappingProxyType({op: self.start + s for op, s in sorted(self.slice_of.items())})

    def level(self, op: OperatorId, iteration: int) -> Level:
        offset = iteration - self.start
        s = self.slice_of[op]
        return Level.FULL if s == offset else Level.COMPUTE if s > offset else Level.NONE

    def plan(self, iteration: int) -> SnapshotPlan:
        if not self.contains(iteration):
            raise ValueError(f"iteration {iteration} is outside window [{self.start}, {self.end})")
        return MappingProxyType({op: self.level(op, iteration) for op in sorted(self.slice_of)})

    def to_dict(self) -> dict:
        return {"start": self.start, "length": self.length, "order": [str(op) for op in self.order],
                "slice_of": {str(op): s for op, s in sorted(self.slice_of.items())}}

    @staticmethod
    def from_dict(d: Mapping) -> "SparseWindow":
        return SparseWindow(int(d["start"]), int(d["length"]), tuple(OperatorId.parse(o) for o in d["order"]),
                            MappingProxyType({OperatorId.parse(k): int(v) for k, v in d["slice_of"].items()}))


@dataclass(frozen=True)
class RankSlicing:
    """How one device's operators are sliced: ``num_active`` FULL per iteration, the busiest iteration's
    bytes, and whether it fits in ``bandwidth × t_iter`` (``None`` when no bandwidth was given)."""

    num_ops: int
    num_active: int
    peak_bytes: int
    fits: Optional[bool]


def order_operators(operators: Sequence[OperatorInfo], scores: Mapping[OperatorId, float]) -> list[OperatorId]:
    """``OrderOperators`` (Alg. 1 line 20): experts by ascending score across all layers, ties by
    OperatorId; then the non-expert operators in OperatorId order. Non-experts process every token, so
    they are the most popular operators and are checkpointed last (as G and NE in MoEvement Fig. 8)."""
    experts = sorted((i.op for i in operators if i.op.is_expert), key=lambda op: (scores[op], op))
    others = sorted(i.op for i in operators if not i.op.is_expert)
    return experts + others


def layer_shares(scores: Mapping[OperatorId, float]) -> dict[OperatorId, float]:
    """Each expert's fraction of its layer's total score (0 for a layer with no tokens)."""
    totals: dict[int, float] = {}
    for op, v in scores.items():
        totals[op.layer] = totals.get(op.layer, 0.0) + v
    return {op: (v / totals[op.layer] if totals[op.layer] > 0 else 0.0) for op, v in scores.items()}


def should_reorder(reference: Mapping[OperatorId, float], current: Mapping[OperatorId, float], *,
                   change: float, fraction: float) -> bool:
    """MoEvement §3.5: reorder when the activation frequency (share of its layer's tokens) of at least
    ``fraction`` of the experts changed by more than ``change`` (relative) since the last ordering. An
    expert with no recorded share changes when it gets any."""
    if not current:
        return False
    changed = 0
    for op, p in current.items():
        ref = reference.get(op, 0.0)
        changed += (abs(p - ref) > change * ref) if ref > 0 else (p > 0)
    return changed >= fraction * len(current)


def _by_rank(operators: Sequence[OperatorInfo], order: Sequence[OperatorId]) -> dict[RankKey, list[OperatorInfo]]:
    info = {i.op: i for i in operators}
    ranks: dict[RankKey, list[OperatorInfo]] = {}
    for op in order:
        ranks.setdefault(rank_key(info[op]), []).append(info[op])
    return dict(sorted(ranks.items()))


def layout_window(operators: Sequence[OperatorInfo], order: Sequence[OperatorId], *, window: Optional[int],
                  bandwidth_bytes_per_s: Optional[float], t_iter_s: Optional[float]
                  ) -> tuple[int, dict[OperatorId, int], dict[RankKey, RankSlicing]]:
    """Window length, slice of every operator, and the per-device slicing report.

    ``window=None`` (auto): every device runs ``FindWindowSize`` on its operators in ``order``; the job
    window is the largest. A device whose own window is shorter then takes the fewest active operators
    per iteration that still fit its link and end within the window (it exists: the device's own
    ``FindWindowSize`` choice qualifies). With a fixed ``window`` each device takes
    ``ceil(num_ops / window)`` operators per iteration.
    """
    ranks = _by_rank(operators, order)
    budget = None
    if bandwidth_bytes_per_s is not None and t_iter_s is not None:
        budget = bandwidth_bytes_per_s * t_iter_s
    if window is None:
        if bandwidth_bytes_per_s is None or t_iter_s is None:
            raise ValueError("window='auto' needs bandwidth_bytes_per_s and t_iter_s (or give a fixed window)")
        choices = {k: find_window_size([i.bytes_full for i in ops], [i.bytes_compute for i in ops],
                                       bandwidth_bytes_per_s=bandwidth_bytes_per_s, t_iter_s=t_iter_s)
                   for k, ops in ranks.items()}
        window = max(c.window for c in choices.values())
    slices: dict[OperatorId, int] = {}
    report: dict[RankKey, RankSlicing] = {}
    for key, ops in ranks.items():
        full, compute = [i.bytes_full for i in ops], [i.bytes_compute for i in ops]
        num_active = math.ceil(len(ops) / window)
        if budget is not None:
            for a in range(num_active, len(ops) + 1):
                if window_peak_bytes(full, compute, a) <= budget:
                    num_active = a
                    break
        peak = window_peak_bytes(full, compute, num_active)
        report[key] = RankSlicing(len(ops), num_active, peak, None if budget is None else peak <= budget)
        for pos, info in enumerate(ops):
            slices[info.op] = pos // num_active
    return window, slices, report
