"""Partial Experts Checkpointing (MoC-System §3, §3.2, §5.1, §5.3).

At every checkpoint (every ``interval`` iterations) the non-expert operators (dense, gates, embedding,
output) are FULL and ``K`` experts of each MoE layer are FULL; the other experts are NONE (PEC is lossy:
on recovery they come back at their last FULL state and the recovery code reports PLT, MoC eq. 7).

*Sequential selection* (§3.2, Fig. 4) walks through the experts of each layer ``K`` at a time. The experts
of a layer are visited rank-interleaved (local expert 0 of EP rank 0, of rank 1, …, then local expert 1 …)
and layer ``o`` (its ordinal among the MoE layers) is shifted by ``o * K`` positions, so the experts
saved by all layers of a pipeline stage at one checkpoint form one contiguous run of the interleaved
order: with ``R`` EP ranks holding ``N/R`` experts each (``R | N``), the numbers of FULL experts on any
two EP ranks of a stage differ by at most one.
*Load-aware selection* saves the ``K`` experts with the most tokens since their last FULL snapshot (the
"unsaved updates" of §3.2; needs :meth:`ExpertPopularity.mark_full` after each snapshot), experts without a
FULL entry yet first (not in the paper: by tokens alone an expert routed none is never saved, and lossy
recovery has no point until every expert has a FULL entry; docs/policies.md).

*Dynamic-K* (§5.3): the recovery code calls :meth:`PECPolicy.on_recovery` with the PLT of each recovery;
once the PLT accumulated under the current ``K`` exceeds the threshold (3.75 %), ``K`` doubles (up to
all experts) for checkpoints after the recovery point, and the accumulator restarts.

*Two-level PEC* (§5.1): :meth:`PECPolicy.persist_plan` picks ``k_persist`` of a checkpoint's FULL
experts per layer for durable storage: those whose persisted copy is oldest, so every expert reaches
storage eventually.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from moe_ft.policy.base import (
    SnapshotPolicy,
    expert_scores,
    experts_by_layer,
    make_plan,
    never_saved,
    top_by_score,
)
from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan
from moe_ft.store.rules import NewestFullRule

SELECTIONS = ("sequential", "load_aware")


@dataclass(kw_only=True)
class PECConfig:
    k_snapshot: int = 1
    """``K_snapshot``: experts per MoE layer saved FULL at each checkpoint (the initial K of Dynamic-K)."""
    k_persist: int = 1
    """``K_persist`` <= ``k_snapshot``: of those, experts per layer also written to durable storage (§5.1)."""
    selection: str = "sequential"
    """``sequential`` (rank-interleaved round robin) or ``load_aware`` (most tokens since last FULL)."""
    dynamic_k: bool = True
    """Double K when the PLT accumulated under the current K exceeds ``plt_threshold`` (§5.3)."""
    plt_threshold: float = 0.0375
    """PLT limit of Dynamic-K, a fraction (MoC §3.1.2: accuracy holds below 3.75 %)."""
    interval: int = 1
    """``I_ckpt``: checkpoint after iterations ``t`` with ``t % interval == 0``; other iterations are NONE."""

    def __post_init__(self) -> None:
        if self.k_snapshot < 1:
            raise ValueError(f"PECConfig.k_snapshot must be >= 1, got {self.k_snapshot}")
        if not 1 <= self.k_persist <= self.k_snapshot:
            raise ValueError(f"PECConfig.k_persist must be in [1, k_snapshot={self.k_snapshot}], got {self.k_persist}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"PECConfig.selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not 0.0 < self.plt_threshold < 1.0:
            raise ValueError(f"PECConfig.plt_threshold is a fraction in (0, 1), got {self.plt_threshold}")
        if self.interval < 1:
            raise ValueError(f"PECConfig.interval must be >= 1, got {self.interval}")


def interleaved_order(experts: Sequence[OperatorInfo]) -> list[OperatorInfo]:
    """Experts of one layer ordered (local index, EP rank, expert): consecutive entries sit on
    different EP ranks (MoC Fig. 4)."""
    local_idx: dict[OperatorId, int] = {}
    seen: dict[tuple[int, int], int] = {}
    for info in sorted(experts, key=lambda i: i.op):
        key = (info.pp_rank, info.ep_rank)
        local_idx[info.op] = seen.get(key, 0)
        seen[key] = local_idx[info.op] + 1
    return sorted(experts, key=lambda i: (local_idx[i.op], i.ep_rank, i.op))


class PECPolicy(SnapshotPolicy):
    """MoC partial experts checkpointing; see the module docstring."""

    name = "pec"
    lossy = True
    token_loss_metric = "PLT"

    @classmethod
    def config_from_flags(cls, flags, t_iter_s: float, *, replication=None) -> "PECConfig":
        """``--ft-pec-k`` experts per layer, doubled by Dynamic-K (MoC §5.3) unless ``--ft-pec-fixed-k``."""
        return PECConfig(k_snapshot=flags.pec_k, k_persist=flags.pec_k_persist, selection=flags.pec_selection,
                         dynamic_k=not flags.pec_fixed_k)

    @classmethod
    def check_flags(cls, config) -> None:
        interval = config.persist.interval
        if interval > 1:
            raise ValueError(f"--ft-persist-interval {interval} with --ft-policy pec: pec persists K_persist "
                             "experts of every snapshot (MoC §5.1), so a durable point would never hold every "
                             "expert's FULL state (the sequential expert cycle aliases with the interval); use "
                             "--ft-persist-interval 1 (or 0 = no durable tier)")

    def recovery_rule(self, operators, *, store=None, start_iteration: int = 0):
        """Each operator's newest FULL entry (MoC §3: PEC restores experts from different checkpoints)."""
        return NewestFullRule(operators=frozenset(operators))

    def token_loss_denominator(self, end: int, *, train_iters: int, tokens_per_iteration: float) -> float:
        """MoC eq. 7: PLT is a fraction of all tokens routed over the whole training run."""
        return float(train_iters * tokens_per_iteration)

    def after_recovery(self, iteration: int, token_loss: float) -> dict:
        """Dynamic-K (MoC §5.3) after a recovery; the report shows K before and after."""
        k_before = self.k
        return {"k_before": k_before, "k_after": self.on_recovery(iteration, token_loss)}

    def __init__(self, config: PECConfig, operators: Sequence[OperatorInfo]) -> None:
        super().__init__(operators)
        self.config = config
        self._layers = experts_by_layer(self.operators)
        if not self._layers:
            raise ValueError("pec needs expert operators; the catalogue has none")
        self._order = {layer: interleaved_order(exps) for layer, exps in self._layers.items()}
        self._ordinal = {layer: o for o, layer in enumerate(self._layers)}
        self.max_k = max(len(e) for e in self._layers.values())
        k0 = min(config.k_snapshot, self.max_k)
        # K segments: from checkpoint index base_c on, layer cursors advance by k from base_cursor.
        self._segments: list[tuple[int, int, int]] = [(0, 0, k0)]  # (base_c, base_cursor, k)
        self.accumulated_plt = 0.0
        self._last_persisted: dict[OperatorId, int] = {}
        self._persist_cache: Optional[tuple[int, SnapshotPlan]] = None

    # ------------------------------------------------------------------------------------ K
    @property
    def k(self) -> int:
        """The current ``K_snapshot`` (after any Dynamic-K doubling)."""
        return self._segments[-1][2]

    def _segment(self, checkpoint_idx: int) -> tuple[int, int, int]:
        starts = [s[0] for s in self._segments]
        return self._segments[max(bisect.bisect_right(starts, checkpoint_idx) - 1, 0)]

    def on_recovery(self, iteration: int, plt: float) -> int:
        """Dynamic-K (MoC §5.3). ``plt``: the PLT (fraction, MoC eq. 7) incurred by the recovery that
        resumed training after ``iteration``. Returns K for the checkpoints after ``iteration``."""
        if plt < 0:
            raise ValueError(f"PLT is a non-negative fraction, got {plt}")
        self.accumulated_plt += plt
        if self.config.dynamic_k and self.accumulated_plt > self.config.plt_threshold and self.k < self.max_k:
            new_k = min(2 * self.k, self.max_k)
            base_c = iteration // self.config.interval + 1
            # Drop segments that would start after the new one (a recovery rolled back past them).
            self._segments = [s for s in self._segments if s[0] < base_c] or [self._segments[0]]
            seg_c, seg_cursor, seg_k = self._segments[-1]
            self._segments.append((base_c, seg_cursor + (base_c - seg_c) * seg_k, new_k))
            self.accumulated_plt = 0.0
        return self.k

    # --------------------------------------------------------------------------------- plans
    def is_checkpoint(self, iteration: int) -> bool:
        return iteration % self.config.interval == 0

    def retained_points(self) -> int:
        """Every iteration publishes a point (NONE between checkpoints): each retained checkpoint spans
        ``interval`` of them."""
        return super().retained_points() * self.config.interval

    def selected_experts(self, iteration: int, popularity=None) -> dict[int, list[OperatorId]]:
        """Per MoE layer, the experts FULL after ``iteration`` (empty lists off checkpoint iterations)."""
        if not self.is_checkpoint(iteration):
            return {layer: [] for layer in self._layers}
        c = iteration // self.config.interval
        base_c, base_cursor, k = self._segment(c)
        chosen: dict[int, list[OperatorId]] = {}
        for layer, order in self._order.items():
            n = len(order)
            if self.config.selection == "load_aware":
                if popularity is None:
                    raise ValueError("pec selection='load_aware' ranks experts by tokens since their last FULL "
                                     "snapshot; pass the ExpertPopularity counters to plan()")
                scores = expert_scores(popularity, order, "since_full")
                unsaved = never_saved(popularity, order)  # first, the riskiest first (else never, if routed none)
                picks = top_by_score([i for i in order if i.op in unsaved], scores, min(k, n))
                picks += top_by_score([i for i in order if i.op not in unsaved], scores, min(k, n) - len(picks))
            else:
                picks = self._sequential(layer, base_cursor + (c - base_c) * k, k)
            chosen[layer] = sorted(i.op for i in picks)
        return chosen

    def _sequential(self, layer: int, cursor: int, k: int) -> list[OperatorInfo]:
        """The ``k`` experts of ``layer`` sequential selection saves at ``cursor`` (the layer shifted by its
        ordinal times ``k``: the module docstring)."""
        order = self._order[layer]
        start = cursor + self._ordinal[layer] * k
        return [order[(start + j) % len(order)] for j in range(min(k, len(order)))]

    def retained_plans(self) -> list[SnapshotPlan]:
        """The snapshots the store holds at the least: the two newest recovery points by
        :class:`NewestFullRule` reach back over one cycle of the sequential selection (every expert's newest
        FULL entry: ceil(N/K) checkpoints, MoC-System §3.2) and one checkpoint more, and the one being written
        comes on top: ceil(N/K) + 2 checkpoints at the current K, each with every non-expert operator FULL.
        Load-aware selection keeps at least as many (an expert with few tokens waits longer for its FULL
        snapshot): the sequential cycle is its lower bound."""
        k = self.k
        cycle = max(-(-len(order) // k) for order in self._order.values())
        dense = {i.op: Level.FULL for i in self.operators if not i.op.is_expert}
        plans = []
        for c in range(cycle + 2):
            levels = dict(dense)
            for layer in self._order:
                levels.update({i.op: Level.FULL for i in self._sequential(layer, c * k, k)})
            plans.append(make_plan(self.operators, levels))
        return plans

    def plan(self, iteration: int, popularity=None) -> SnapshotPlan:
        if not self.is_checkpoint(iteration):
            return make_plan(self.operators, {})
        levels = {i.op: Level.FULL for i in self.operators if not i.op.is_expert}
        for ops in self.selected_experts(iteration, popularity).values():
            levels.update({op: Level.FULL for op in ops})
        return make_plan(self.operators, levels)

    def persist_plan(self, iteration: int, snapshot_plan: Mapping[OperatorId, Level]) -> SnapshotPlan:
        """Operators of the snapshot ``snapshot_plan`` (taken after ``iteration``) to write to durable
        storage (MoC §5.1): its FULL non-expert operators and, per layer, the ``k_persist`` FULL experts
        whose persisted copy is oldest (never persisted first, ties by OperatorId). Call it once per
        persisted checkpoint; a repeated call for the same iteration returns the same plan."""
        if self._persist_cache is not None and self._persist_cache[0] == iteration:
            return self._persist_cache[1]
        levels = {op: Level.FULL for op, lvl in snapshot_plan.items() if lvl == Level.FULL and not op.is_expert}
        for layer in self._layers:
            full = [op for op in sorted(snapshot_plan) if op.is_expert and op.layer == layer
                    and snapshot_plan[op] == Level.FULL]
            stalest = sorted(full, key=lambda op: (self._last_persisted.get(op, -1), op))
            for op in stalest[: self.config.k_persist]:
                levels[op] = Level.FULL
                self._last_persisted[op] = iteration
        result = make_plan(self.operators, levels)
        self._persist_cache = (iteration, result)
        return result

    # ---------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "segments": [list(s) for s in self._segments],
            "accumulated_plt": self.accumulated_plt,
            "last_persisted": {str(op): it for op, it in sorted(self._last_persisted.items())},
            "persist_cache_iteration": None if self._persist_cache is None else self._persist_cache[0],
            "persist_cache": None if self._persist_cache is None else
            {str(op): int(lvl) for op, lvl in self._persist_cache[1].items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self._segments = [(int(s[0]), int(s[1]), int(s[2])) for s in state["segments"]]
        self.accumulated_plt = float(state["accumulated_plt"])
        self._last_persisted = {OperatorId.parse(k): int(v) for k, v in state["last_persisted"].items()}
        if state["persist_cache"] is None:
            self._persist_cache = None
        else:
            levels = {OperatorId.parse(k): Level(v) for k, v in state["persist_cache"].items()}
            self._persist_cache = (int(state["persist_cache_iteration"]), make_plan(self.operators, levels))
