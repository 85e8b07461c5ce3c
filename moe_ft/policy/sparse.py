"""Sparse checkpointing (MoEvement §3.2, §3.5, Algorithm 1, App. B): the default, exact policy.

Training is cut into windows of ``W_sparse`` iterations. Within a window every operator is FULL after
exactly one iteration (its *slice*); before that it is COMPUTE, after it NONE, so the snapshots of one
window together hold a consistent dense checkpoint (sparse-to-dense conversion, §3.3). Operators are
ordered by ascending popularity so popular experts stay frozen longest during conversion (§3.5). The
order is decided only at a window boundary, and changes when at least 25 % of the experts changed
their activation frequency by more than 10 % since the last ordering (§3.5), or when a new window is laid
out anyway (``FindWindowSize`` gives another length with ``window="auto"``, or after a forced dense point). Layout arithmetic is in
``sparse_schedule.py``.

Recovery finds its windows through :meth:`SparsePolicy.recovery_rule`: the windows every snapshot's metadata
recorded (``recorded_windows``, current and previous) as a ``SparseWindowRule``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from moe_ft.policy.base import SnapshotPolicy, expert_scores
from moe_ft.policy.sparse_schedule import (
    ORDERS,
    RankSlicing,
    SparseWindow,
    layer_shares,
    layout_window,
    order_operators,
    should_reorder,
)
from moe_ft.policy.window import flags_copy_bandwidth
from moe_ft.state.operators import OperatorId, OperatorInfo, SnapshotPlan
from moe_ft.store.errors import StoreError
from moe_ft.store.rules import SparseWindowRule


def recorded_windows(store) -> list[tuple[int, int]]:
    """The sparse windows ``(start, end)`` as the policy recorded them in the metadata of the store's points
    (its state after each snapshot). Recovery must use these, not windows aligned to this run's start
    iteration: a run resumed from a ``--load`` checkpoint, or whose window length was measured again
    (``--ft-sparse-window 0``), would otherwise look for windows that were never taken."""
    windows: set[tuple[int, int]] = set()
    for it in store.points():
        try:
            policy = store.load_meta(it).meta.get("policy") or {}
        except StoreError:  # a damaged metadata entry: agreement skips its point with the reason anyway
            continue
        for key in ("current", "previous"):
            w = policy.get(key)
            if w:
                windows.add((int(w["start"]), int(w["start"]) + int(w["length"]) - 1))
    return without_abandoned(windows)


def without_abandoned(windows) -> list[tuple[int, int]]:
    """Drop every window inside which a later window starts: it was abandoned there (a dense window opened by
    :meth:`SparsePolicy.start_dense`), and a replay across that iteration would miss what happened at it."""
    starts = sorted({start for start, _ in windows})
    return sorted((s, e) for s, e in windows if not any(s < other <= e for other in starts))


@dataclass(kw_only=True)
class SparseConfig:
    window: Union[int, str] = "auto"
    """``W_sparse``: ``"auto"`` (``FindWindowSize`` per device, Alg. 1) or a fixed number of iterations."""
    bandwidth_bytes_per_s: Optional[float] = None
    """Bytes/s of ``T_iter`` one device's snapshots may take (``B_PCIe``, or less where replication bounds it:
    :func:`moe_ft.policy.window.snapshot_copy_bandwidth`); needed by ``window="auto"``."""
    t_iter_s: Optional[float] = None
    """Iteration time ``T_Iter`` in seconds; needed by ``window="auto"``."""
    order: str = "popularity"
    """``popularity`` (hard counts, §3.5), ``soft`` (gate probabilities), ``ema`` (time-decayed) or
    ``capacity`` (hard counts / capacity), MoEvement App. B."""
    capacity: Optional[Mapping[str, float]] = None
    """For ``order="capacity"``: tokens per batch each expert can take, keyed by ``str(OperatorId)``
    (e.g. ``"expert.L3.E7"``); experts missing from it count as capacity 1."""
    reorder_fraction: float = 0.25
    """Reorder when at least this fraction of experts changed popularity (§3.5: 25 %)."""
    reorder_change: float = 0.10
    """... by more than this relative change of their share of the layer's tokens (§3.5: 10 %)."""

    def __post_init__(self) -> None:
        if isinstance(self.window, str):
            if self.window != "auto":
                raise ValueError(f"SparseConfig.window must be 'auto' or a positive int, got {self.window!r}")
            if self.bandwidth_bytes_per_s is None or self.t_iter_s is None:
                raise ValueError("SparseConfig.window='auto' needs bandwidth_bytes_per_s and t_iter_s "
                                 "(device-to-host bandwidth and iteration time), or set a fixed window")
        elif self.window < 1:
            raise ValueError(f"SparseConfig.window must be >= 1, got {self.window}")
        for name in ("bandwidth_bytes_per_s", "t_iter_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SparseConfig.{name} must be positive, got {value}")
        if self.order not in ORDERS:
            raise ValueError(f"SparseConfig.order must be one of {sorted(ORDERS)}, got {self.order!r}")
        if self.order == "capacity" and not self.capacity:
            raise ValueError("SparseConfig.order='capacity' needs SparseConfig.capacity (tokens per expert)")
        if self.capacity and any(v <= 0 for v in self.capacity.values()):
            raise ValueError("SparseConfig.capacity values must be positive")
        if not 0.0 < self.reorder_fraction <= 1.0 or self.reorder_change < 0:
            raise ValueError("SparseConfig.reorder_fraction must be in (0, 1] and reorder_change >= 0")


class SparsePolicy(SnapshotPolicy):
    """MoEvement sparse checkpointing; see the module docstring."""

    name = "sparse"
    starts_dense = True
    reads_popularity = True

    @classmethod
    def config_from_flags(cls, flags, t_iter_s: float, *, replication=None) -> SparseConfig:
        """A fixed ``--ft-sparse-window``, or ``FindWindowSize`` (Alg. 1) at ``t_iter_s`` from the bandwidth
        :func:`~moe_ft.policy.window.snapshot_copy_bandwidth` gives: ``--ft-snapshot-bandwidth``, and with replicas and a known
        ``--ft-replication-bandwidth`` that bandwidth over ``--ft-replicas`` (each snapshot leaves the rank
        once per replica within the iteration, or the replicas fall behind)."""
        if flags.sparse_window:
            return SparseConfig(window=flags.sparse_window, order=flags.sparse_order)
        bandwidth = flags_copy_bandwidth(flags.snapshot_bandwidth, replication)
        return SparseConfig(window="auto", bandwidth_bytes_per_s=bandwidth, t_iter_s=t_iter_s, order=flags.sparse_order)

    def recovery_rule(self, operators, *, store=None, start_iteration: int = 0):
        """A complete window (MoEvement §3.3): the windows recorded in the store's metadata when there are
        any (:func:`recorded_windows`), else windows aligned to this run's start."""
        windows = recorded_windows(store) if store is not None else []
        if windows:
            return SparseWindowRule.explicit(operators, windows)
        length = self.window_length
        if length is None:
            raise RuntimeError("the sparse policy has no window yet: build its recovery rule after its setup")
        return SparseWindowRule.aligned(operators, length, start_iteration)

    def retention_rule(self, operators):
        """The remembered windows (current, previous), else windows aligned to the current one (after a
        recovery: the restored, recorded window), read from the policy's state each time the store collects
        garbage: after :meth:`start_dense` the one-iteration dense window counts until a window of the
        configured length is complete behind it."""
        if self.current is None:
            raise ValueError("the sparse policy has no window yet: call plan() once before retention_rule()")

        def window_of(end: int) -> tuple[int, int] | None:
            remembered = [w for w in (self.current, self.previous) if w is not None]
            for w in remembered:
                if w.end - 1 == end:
                    return w.start, end
            cur = remembered[0]
            start = end - cur.length + 1
            offset = cur.start % cur.length
            inside = any(w.start < end < w.end - 1 or start < w.start <= end for w in remembered)
            if start < offset or (start - offset) % cur.length or inside:
                return None  # not a window boundary, or across a remembered window's start
            return start, end

        return SparseWindowRule(operators=frozenset(operators), window_of=window_of)

    def __init__(self, config: SparseConfig, operators: Sequence[OperatorInfo]) -> None:
        super().__init__(operators)
        self.config = config
        self._experts = [i for i in self.operators if i.op.is_expert]
        if config.capacity:
            known = {str(i.op) for i in self._experts}
            unknown = sorted(set(config.capacity) - known)
            if unknown:
                raise ValueError(f"SparseConfig.capacity names unknown experts {unknown[:5]}")
        self.current: Optional[SparseWindow] = None
        self.previous: Optional[SparseWindow] = None
        self.slicing: dict = {}
        """Per rank key, the :class:`RankSlicing` of the current window (peak bytes, whether it fits)."""
        self.num_reorders = 0
        self._reference: dict[OperatorId, float] = {}
        # Runs on the training thread every iteration, so what repeats is remembered: the plan of each offset
        # of a window (windows of one ordering share their ``slice_of``; plans are immutable mappings), and
        # the encoded parts of the state (the windows' order and slices, the reference, the slicing report),
        # each as long as the object it encodes is the same one (they are replaced, never changed in place).
        self._plans: tuple[Mapping | None, dict[int, SnapshotPlan]] = (None, {})
        self._encoded: dict[int, tuple[object, object]] = {}

    # -------------------------------------------------------------------------------- ordering
    def scores(self, popularity) -> dict[OperatorId, float]:
        """The ordering score of every expert (App. B)."""
        raw = expert_scores(popularity, self._experts, ORDERS[self.config.order])
        if self.config.order == "capacity":
            cap = self.config.capacity or {}
            raw = {op: v / float(cap.get(str(op), 1.0)) for op, v in raw.items()}
        return raw

    def _new_window(self, start: int, scores: Mapping[OperatorId, float]) -> SparseWindow:
        order = order_operators(self.operators, scores)
        fixed = None if self.config.window == "auto" else int(self.config.window)
        length, slices, self.slicing = layout_window(
            self.operators, order, window=fixed,
            bandwidth_bytes_per_s=self.config.bandwidth_bytes_per_s, t_iter_s=self.config.t_iter_s)
        self._reference = layer_shares(scores)
        return SparseWindow(start, length, tuple(order), slices)

    def _auto_length(self, order) -> int:
        """``W_sparse`` that ``FindWindowSize`` gives now (the current length with a fixed window)."""
        if self.config.window != "auto":
            return int(self.config.window)
        length, _, _ = layout_window(self.operators, order, window=None,
                                     bandwidth_bytes_per_s=self.config.bandwidth_bytes_per_s,
                                     t_iter_s=self.config.t_iter_s)
        return length

    def observe_iteration_time(self, t_iter_s: float) -> None:
        """With ``window="auto"`` the next window boundary runs ``FindWindowSize`` with this ``T_iter``."""
        if self.config.window == "auto":
            self.config.t_iter_s = t_iter_s

    def _advance(self, iteration: int, popularity) -> None:
        cur = self.current
        assert cur is not None
        start = cur.start + cur.length * ((iteration - cur.start) // cur.length)
        scores = self.scores(popularity)
        if should_reorder(self._reference, layer_shares(scores), change=self.config.reorder_change,
                          fraction=self.config.reorder_fraction):
            nxt = self._new_window(start, scores)
            self.num_reorders += 1
        elif self._auto_length(cur.order) != cur.length:  # T_iter changed: FindWindowSize again (Alg. 1)
            nxt = self._new_window(start, scores)
        else:
            nxt = SparseWindow(start, cur.length, cur.order, cur.slice_of)
        self.previous = SparseWindow(start - cur.length, cur.length, cur.order, cur.slice_of)
        self.current = nxt

    def start_dense(self, iteration: int) -> None:
        """A one-iteration window at ``iteration`` with every operator FULL: a recovery point by itself. The
        window in progress is abandoned (recovery never replays across ``iteration``: :func:`without_abandoned`);
        the next :meth:`plan` call past it opens a window of the configured length at ``iteration + 1``."""
        cur = self.current
        if cur is None:
            raise ValueError("the sparse policy has no window yet: call plan() once before start_dense()")
        self.previous = cur if cur.end <= iteration else None  # a complete window stays remembered
        self.current = SparseWindow(iteration, 1, cur.order, {op: 0 for op in cur.slice_of})

    # ----------------------------------------------------------------------------------- plans
    def plan(self, iteration: int, popularity=None) -> SnapshotPlan:
        """The plan after ``iteration``. The first call opens the first window at ``iteration``; a call past
        the current window opens the next one (reordering only then); a call inside the previous window
        (a recovery replay) returns that window's plan unchanged."""
        if self.current is None:
            self.current = self._new_window(iteration, self.scores(popularity))
        elif iteration >= self.current.end:
            self._advance(iteration, popularity)
        window = self.window_of(iteration)
        slices, plans = self._plans
        if slices is not window.slice_of:
            self._plans = (window.slice_of, plans := {})
        offset = iteration - window.start
        plan = plans.get(offset)
        if plan is None:
            plan = plans[offset] = window.plan(iteration)
        return plan

    def window_of(self, iteration: int) -> SparseWindow:
        """The remembered window (current or previous) holding ``iteration``: its ``start``, ``length``,
        ``order`` and ``activation_iteration(op)`` / ``activation_schedule()`` for recovery."""
        for win in (self.current, self.previous):
            if win is not None and win.contains(iteration):
                return win
        known = [f"[{w.start}, {w.end})" for w in (self.previous, self.current) if w is not None]
        raise ValueError(f"iteration {iteration} is in no remembered window (known: {known}); restore the "
                         "policy state_dict saved with the snapshot you recover from")

    def recovery_window(self, failed_iteration: int) -> SparseWindow:
        """The newest remembered window all of whose snapshots were taken before ``failed_iteration`` (the
        first iteration that did not complete): sparse-to-dense conversion starts at its ``start`` and
        activates each operator at ``activation_iteration(op)`` (MoEvement §3.3, §3.6). Only window starts
        are recovery points: at any later iteration of a window some operators are NONE."""
        for win in (self.current, self.previous):
            if win is not None and win.end <= failed_iteration:
                return win
        raise ValueError(f"no complete window before iteration {failed_iteration}; windows remembered: "
                         f"{[(w.start, w.end) for w in (self.previous, self.current) if w is not None]}; "
                         "fall back to the last dense (persisted) checkpoint")

    def window_progress(self, iteration: int) -> str:
        w = self.window_of(iteration)
        return f"{iteration - w.start + 1}/{w.length}"

    @property
    def window_length(self) -> Optional[int]:
        return None if self.current is None else self.current.length

    def recovery_point_plans(self) -> Optional[list[SnapshotPlan]]:
        """The current window's plans (a recovery point is a whole window, MoEvement §3.2)."""
        win = self.current
        return None if win is None else [win.plan(t) for t in range(win.start, win.end)]

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The policy's state (JSON types). Captured with every snapshot's metadata: its nested parts are
        shared between calls while unchanged (do not modify them)."""
        used: dict[int, tuple[object, object]] = {}

        def encoded(obj, encode):
            hit = self._encoded.get(id(obj))
            value = hit[1] if hit is not None and hit[0] is obj else encode(obj)
            used[id(obj)] = (obj, value)
            return value

        def window(w: SparseWindow | None) -> dict | None:
            if w is None:
                return None
            return {"start": w.start, "length": w.length,
                    "order": encoded(w.order, lambda order: [str(op) for op in order]),
                    "slice_of": encoded(w.slice_of, lambda sl: {str(op): s for op, s in sorted(sl.items())})}

        state = {
            "name": self.name,
            "current": window(self.current),
            "previous": window(self.previous),
            "reference": encoded(self._reference, lambda ref: {str(op): v for op, v in sorted(ref.items())}),
            "slicing": encoded(self.slicing, lambda sl: {f"{k[0]},{k[1]}": vars(v) for k, v in sorted(sl.items())}),
            "num_reorders": self.num_reorders,
        }
        self._encoded = used  # what the windows no longer hold is dropped
        return state

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        self.current = None if state["current"] is None else SparseWindow.from_dict(state["current"])
        self.previous = None if state["previous"] is None else SparseWindow.from_dict(state["previous"])
        if self.current is not None and set(self.current.slice_of) != set(self.info):
            raise ValueError("sparse policy state was saved for a different operator catalogue")
        self._reference = {OperatorId.parse(k): float(v) for k, v in state["reference"].items()}
        self.slicing = {tuple(int(x) for x in k.split(",")): RankSlicing(**v) for k, v in state["slicing"].items()}
        self.num_reorders = int(state["num_reorders"])
