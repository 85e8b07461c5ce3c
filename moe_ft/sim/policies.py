"""Per-policy cost of checkpointing and of recovery (the snapshot policies, seen through the cost model).

A :class:`PolicyModel` answers, for one configuration: how many iterations a *period* lasts (dense: the
interval ``k``; sparse: the window ``W_sparse``; PEC and selective: one iteration), how much wall time
a period costs (iterations plus the stall of MoC eq. 10), and how long a recovery takes when a failure
hits stage ``s`` at iteration ``phase`` of the period. The analytic ETTR (:mod:`moe_ft.sim.analytic`)
averages these over failure positions; the simulator (:mod:`moe_ft.sim.simulator`) draws them.

Snapshots go in two phases per rank: device→host over PCIe, which must finish within the next forward and
backward pass (MoC eq. 10), then ``r`` copies to peers over the network (or one to durable storage for
``store="storage"``), which may take until the next snapshot starts. The budgets the sparse window, PEC's
fitting K and selective's experts are sized by are the runtime's (:func:`_budget_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moe_ft.policy.window import WindowChoice, find_window_size, snapshot_copy_bandwidth
from moe_ft.sim.costmodel import CostModel, RankOperator
from moe_ft.sim.formulas import moetion_experts_per_iter, snapshot_stall_s

POLICY_KINDS = ("dense", "sparse", "pec", "selective")
ALIASES = {  # the paper baselines Gemini, CheckFreq and MoC-System restart the whole job after a failure
    "gemini": "dense:store=memory:interval=oracle:launcher=torchrun",
    "checkfreq": "dense:store=storage:interval=cap:max_overhead=0.03:launcher=torchrun",
    "dense-daly": "dense:interval=daly",
    "moc": "pec:k=dynamic:launcher=torchrun",
    "moetion": "selective",
    "moevement": "sparse",
}


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """A policy and its knobs, parsed from ``kind[:key=value]...`` (e.g. ``dense:interval=50``)."""

    kind: str
    label: str
    interval: str = "oracle"  # dense: an integer, "oracle" (sweep for max ETTR), "daly", or "cap"
    max_overhead: float = 0.03  # dense interval=cap: smallest interval with overhead <= this (CheckFreq)
    store: str = "memory"  # dense: "memory" (peer CPU memory, Gemini) or "storage" (durable, CheckFreq)
    k: str = "fit"  # pec: experts per layer per snapshot, an integer, "fit" or "dynamic" (MoC Dynamic-K)
    localized: bool = True  # sparse: upstream logging confines recovery to the failed stage (MoEvement §3.4)
    localized_model: str = "runtime"
    """sparse with ``localized``: ``runtime`` = what moe-ft does (the survivors dump their state and load it
    back, only the failed stage replays; ``moe_ft/recovery/localized.py``), ``paper`` = MoEvement §3.4's
    model (only the failed data-parallel group restarts, ``localized_restart_s``, the others pause)."""
    launcher: str = "inprocess"
    """How the job gets its processes back, for every policy (``moe-ft launch`` recovers whatever the policy;
    ``sparse:localized=paper`` charges MoEvement's ``localized_restart_s`` instead). ``inprocess``: ``moe-ft
    launch`` with spares, the survivors keep their processes, spares take the lost node's ranks (``recovery.
    inprocess_detect_s`` + ``inprocess_reform_s``); ``torchrun``: every process starts again (the global
    ``restart_s``; also ``moe-ft launch``'s fallback to a full restart, and what the aliases ``gemini``,
    ``checkfreq`` and ``moc`` use: those systems restart the job). Not modelled: ``moe-ft launch`` with no spare
    left on a fixed node count, where the survivors keep their processes and wait for a replacement node (its
    provisioning and start are the cluster's, not the launcher's)."""
    plt_budget: float = 0.0375  # pec: MoC's PLT threshold (§3, Dynamic-K)
    k0: int = 0  # pec k=dynamic: K the simulated run starts from (0: the largest K that fits, MoC §5.3)

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy {self.kind!r}; expected one of {POLICY_KINDS} or {sorted(ALIASES)}")
        if self.store not in ("memory", "storage"):
            raise ValueError("store must be 'memory' or 'storage'")
        if self.interval not in ("oracle", "daly", "cap") and not (self.interval.isdigit() and int(self.interval) > 0):
            raise ValueError(f"interval must be a positive integer, 'oracle', 'daly' or 'cap', got {self.interval!r}")
        if self.k not in ("fit", "dynamic") and not (self.k.isdigit() and int(self.k) > 0):
            raise ValueError(f"pec k must be a positive integer, 'fit' or 'dynamic', got {self.k!r}")
        if self.launcher not in ("inprocess", "torchrun"):
            raise ValueError(f"launcher must be 'inprocess' or 'torchrun', got {self.launcher!r}")
        if self.localized_model not in ("runtime", "paper"):
            raise ValueError(f"localized must be 0, 1, 'runtime' or 'paper', got {self.localized_model!r}")


def parse_policy(text: str) -> PolicySpec:
    """``dense``, ``dense:interval=57``, ``dense:store=storage:interval=cap``, ``pec:k=2``,
    ``sparse:localized=0`` (global replay), ``sparse:localized=paper`` (MoEvement's restart model; the
    default ``sparse`` = ``sparse:localized=runtime`` models what the runtime does), any of them with
    ``:launcher=torchrun`` (a full restart instead of ``moe-ft launch``'s in-process recovery), or an alias
    (``gemini``, ``checkfreq``, ``dense-daly``, ``moc``, ``moetion``, ``moevement``)."""
    label = text.strip()
    expanded = ALIASES.get(label, label)
    kind, *pairs = expanded.split(":")
    kwargs: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"policy option {pair!r} in {text!r} must be key=value")
        if key in ("max_overhead", "plt_budget"):
            kwargs[key] = float(value)
        elif key == "k0":
            kwargs[key] = int(value)
        elif key == "localized":
            mode = value.lower()
            if mode in ("runtime", "paper"):
                kwargs["localized"], kwargs["localized_model"] = True, mode
            elif mode in ("1", "true", "yes", "0", "false", "no"):
                kwargs["localized"] = mode in ("1", "true", "yes")
            else:
                raise ValueError(f"localized must be 0, 1, 'runtime' or 'paper' in {text!r}, got {value!r}")
        elif key in ("interval", "store", "k", "launcher"):
            kwargs[key] = value
        else:
            raise ValueError(f"unknown policy option {key!r} in {text!r}; known: interval, max_overhead, "
                             "store, k, k0, localized, launcher, plt_budget")
    return PolicySpec(kind=kind, label=label, **kwargs)


@dataclass
class PolicyModel:
    """Costs of one policy with fixed knobs. ``period_iters`` iterations cost ``period_wall_s``."""

    spec: PolicySpec
    cost: CostModel
    period_iters: int
    stall_s: float  # stall added per period (T_ckpt of the ETTR formula, per checkpoint)
    t_snapshot_s: float  # copy time of the largest per-rank snapshot (both phases, not overlapped)
    checkpoint_bytes: float  # per rank, largest snapshot
    knobs: dict = field(default_factory=dict)
    windows: tuple[WindowChoice, ...] = ()  # sparse: per stage
    lossy_staleness_iters: float = 0.0  # mean iterations of expert updates lost per failure (PLT/MLT)

    @property
    def t_iter_s(self) -> float:
        return self.cost.iteration.t_iter_s

    @property
    def period_wall_s(self) -> float:
        return self.period_iters * self.t_iter_s + self.stall_s

    @property
    def interval(self) -> int:
        """Iterations between checkpoint starts (1 for policies that snapshot every iteration)."""
        return self.period_iters if self.spec.kind == "dense" else 1

    @property
    def overhead(self) -> float:
        return self.stall_s / (self.period_iters * self.t_iter_s)

    @property
    def localized(self) -> bool:
        return self.spec.kind == "sparse" and self.spec.localized

    def restart_load_s(self) -> float:
        """Restart (global, or MoEvement's localized one for ``localized=paper``) plus loading the replacement
        node's state; the runtime's localized recovery (``localized=runtime``) adds the survivors' dump and
        load of their state (device to host and back, ``d2h_bandwidth``). Under ``moe-ft launch``
        (``launcher=inprocess``, any policy) the lost node's detection and the re-formation of the groups
        around the spares replace the global restart."""
        cfg = self.cost.config
        hw = cfg.hardware
        held = self.cost.max_held_bytes
        if self.spec.kind == "dense" and self.spec.store == "storage":
            node = hw.gpus_per_node
            load = held * node / min(hw.storage_bandwidth, hw.network_bandwidth * node)
        else:  # the replacement node pulls its state from a peer replica
            load = held / hw.network_bandwidth
        if self.localized and self.spec.localized_model == "paper":
            return cfg.recovery.localized_restart_s + load
        survivors = 2.0 * held / hw.d2h_bandwidth if self.localized else 0.0
        restart = cfg.recovery.restart_s
        if self.spec.launcher == "inprocess":
            restart = cfg.recovery.inprocess_detect_s + cfg.recovery.inprocess_reform_s
        return restart + survivors + load

    def recovery_s(self, phase: float, stage_idx: int, segment: int = 1) -> float:
        """Wall time from a failure to being back where the job was. ``phase`` in ``[0, period_iters)``
        is where in the period the failure struck (fractional part: within the iteration).

        A checkpoint is a recovery point only once its last copy has landed (``t_snapshot_s`` after it
        started); a failure before that rolls back one more period. Averaged over the phase, the lost
        work is uniform on ``[L, P + L]``, so the commit latency ``L`` adds to every recovery."""
        base = self.restart_load_s()
        if self.spec.kind == "dense":
            return base + self.t_snapshot_s + phase / self.period_iters * self.period_wall_s
        if self.spec.kind in ("pec", "selective"):
            return base + self.t_snapshot_s + (phase - math.floor(phase)) * self.t_iter_s
        return base + self._sparse_replay_s(phase + self.t_snapshot_s / self.t_iter_s, stage_idx, segment)

    @property
    def frozen_cost(self) -> float:
        """A frozen operator's replay cost relative to an active one's: ``recovery.frozen_cost`` (the runtime
        computes and drops its weight gradient: 1), or ``recovery.paper_frozen_cost`` under MoEvement's model
        (``localized=paper``; §3.3: no weight gradient, ≈ 2/3)."""
        rec = self.cost.config.recovery
        return rec.paper_frozen_cost if self.localized and self.spec.localized_model == "paper" else rec.frozen_cost

    def _sparse_replay_s(self, phase: float, stage_idx: int, segment: int) -> float:
        """Sparse-to-dense conversion over the last complete window, then the iterations since
        (MoEvement §3.3: on average ⌈3/2·W⌉ iterations). Frozen operators cost :attr:`frozen_cost`."""
        frozen = self.frozen_cost
        ops = _checkpoint_order(self.cost.rank_operators(stage_idx))
        choice = self.windows[stage_idx]
        total = sum(o.flops_share for o in ops) or 1.0

        def replay_iter(factor: float) -> float:
            if self.spec.localized:
                return self.cost.stage_replay_s(stage_idx, factor, segment=segment)
            it = self.cost.iteration
            return it.t_pipeline_s * factor + it.t_sync_s + it.t_update_s

        t = 0.0
        for i in range(choice.window):
            active = sum(o.flops_share for o in ops[: (i + 1) * choice.num_active]) / total
            t += replay_iter(active + (1.0 - active) * frozen)
        return t + phase * replay_iter(1.0)


def _checkpoint_order(ops: list[RankOperator]) -> list[RankOperator]:
    """MoEvement ``OrderOperators``: ascending popularity. With no popularity trace every expert is
    equally popular; non-expert operators see every token, so they come last."""
    return [o for o in ops if o.op.is_expert] + [o for o in ops if not o.op.is_expert]


def _phase_times(cost: CostModel, nbytes: float, replicas_or_storage: str) -> tuple[float, float]:
    """(device→host seconds, second-phase seconds) of a per-rank snapshot of ``nbytes``."""
    cfg = cost.config
    hw = cfg.hardware
    d2h = nbytes / hw.d2h_bandwidth
    if replicas_or_storage == "storage":
        world_bytes = nbytes * cfg.parallel.world_size
        return d2h, world_bytes / hw.storage_bandwidth
    return d2h, cfg.recovery.replicas * nbytes / hw.network_bandwidth


def dense_stall_curve(cost: CostModel, spec: PolicySpec, intervals: np.ndarray) -> np.ndarray:
    """Stall of one dense checkpoint taken every ``k`` iterations, for each ``k`` of ``intervals``: the
    device-to-host copy the next forward and backward pass cannot hide (MoC-System eq. 10), the second phase
    (replication or storage) the interval cannot hide, and the trainer's host work on the bytes
    (:func:`host_work_s`). :func:`dense_model` charges it and the interval rules choose on it."""
    it = cost.iteration
    nbytes = max(cost.snapshot_bytes(s, "full") for s in range(cost.config.parallel.pp))
    d2h, second = _phase_times(cost, nbytes, spec.store)
    return (snapshot_stall_s(d2h, it.t_pipeline_s) + np.maximum(0.0, second - intervals * it.t_iter_s)
            + host_work_s(cost, nbytes))


def host_work_s(cost: CostModel, nbytes: float) -> float:
    """Training time a snapshot of ``nbytes`` per rank costs the trainer's host even where its copies are
    hidden: ``HardwareSpec.host_s_per_byte`` per byte plus ``host_s_per_snapshot``."""
    hw = cost.config.hardware
    return nbytes * hw.host_s_per_byte + hw.host_s_per_snapshot


def dense_model(cost: CostModel, spec: PolicySpec, interval: int) -> PolicyModel:
    """FULL for every operator every ``interval`` iterations (CheckFreq / Gemini)."""
    nbytes = max(cost.snapshot_bytes(s, "full") for s in range(cost.config.parallel.pp))
    d2h, second = _phase_times(cost, nbytes, spec.store)
    stall = float(dense_stall_curve(cost, spec, np.array([float(interval)]))[0])
    return PolicyModel(spec=spec, cost=cost, period_iters=interval, stall_s=stall, t_snapshot_s=d2h + second,
                       checkpoint_bytes=nbytes, knobs={"interval": interval, "store": spec.store})


def _copy_bandwidth(cost: CostModel) -> float:
    """The bytes/s per second of ``T_iter`` the runtime sizes snapshots by
    (:func:`~moe_ft.policy.window.snapshot_copy_bandwidth`), with ``d2h_bandwidth`` as ``--ft-snapshot-bandwidth``
    and ``network_bandwidth`` as ``--ft-replication-bandwidth`` for ``recovery.replicas`` replicas."""
    hw = cost.config.hardware
    return snapshot_copy_bandwidth(snapshot_bandwidth=hw.d2h_bandwidth, replication_bandwidth=hw.network_bandwidth,
                                   num_replicas=cost.config.recovery.replicas)


def _budget_bytes(cost: CostModel) -> float:
    """Per-rank bytes one iteration may snapshot as the runtime sizes them (MoEvement Alg. 1's check, MoEtion
    §4.2's B_local and B_remote): :func:`_copy_bandwidth` × ``T_iter``. ``T_iter``, not the forward and backward
    pass the device-to-host copy actually has, because ``T_iter`` is what the runtime measures
    (``IterationClock``); the part of a copy that the pass cannot hide is charged as a stall."""
    return _copy_bandwidth(cost) * cost.iteration.t_iter_s


def _per_iter_stall(cost: CostModel, nbytes: float, remote_bytes: float | None = None) -> tuple[float, float]:
    """The stall a snapshot of ``nbytes`` per rank, of which ``remote_bytes`` (default: all) are replicated,
    adds to its iteration (the copies' unhidden part, plus the trainer's host work: :func:`host_work_s`), and
    the copies' time."""
    it = cost.iteration
    d2h, _ = _phase_times(cost, nbytes, "memory")
    _, second = _phase_times(cost, nbytes if remote_bytes is None else remote_bytes, "memory")
    return (snapshot_stall_s(d2h, it.t_pipeline_s) + snapshot_stall_s(second, it.t_iter_s)
            + host_work_s(cost, nbytes), d2h + second)


def sparse_model(cost: CostModel, spec: PolicySpec) -> PolicyModel:
    """MoEvement sparse checkpointing: per stage, ``FindWindowSize`` (Alg. 1, per-operator sizes) at the
    runtime's bandwidth (:func:`_copy_bandwidth`) and ``T_iter``; the job's window is the largest stage window."""
    it = cost.iteration
    bandwidth = _copy_bandwidth(cost)
    windows, peaks = [], []
    for s in range(cost.config.parallel.pp):
        ops = _checkpoint_order(cost.rank_operators(s))
        # the model's sizes are float bytes; Alg. 1's arithmetic is the same for them
        choice = find_window_size([o.bytes_full for o in ops], [o.bytes_compute for o in ops],  # type: ignore[misc]
                                  bandwidth_bytes_per_s=bandwidth, t_iter_s=it.t_iter_s)
        windows.append(choice)
        peaks.append(choice.peak_bytes)
    peak = max(peaks)
    stall, t_snap = _per_iter_stall(cost, peak)
    w = max(c.window for c in windows)
    return PolicyModel(spec=spec, cost=cost, period_iters=w, stall_s=w * stall, t_snapshot_s=t_snap,
                       checkpoint_bytes=peak, windows=tuple(windows),
                       knobs={"window": w, "localized": spec.localized,
                              "active_per_iter": min(c.num_active for c in windows)})


def pec_model(cost: CostModel, spec: PolicySpec, k: int | None = None) -> PolicyModel:
    """MoC partial experts checkpointing: non-expert operators FULL every iteration plus ``K`` experts
    per layer (sequential, interleaved over EP ranks, so a rank saves ``K/ep`` of its experts on
    average). ``k=None`` chooses the largest power of two K (or N) whose snapshot fits the per-iteration copy
    budget (``_budget_bytes``; the host work is not counted); MoC-System §5.3's Dynamic-K doubles K from it."""
    num_experts = cost.config.model.num_experts

    def per_rank_bytes(kk: int) -> float:
        worst = 0.0
        for s in range(cost.config.parallel.pp):
            ops = cost.rank_operators(s)
            ne = sum(o.bytes_full for o in ops if not o.op.is_expert)
            ex = sum(o.bytes_full for o in ops if o.op.is_expert)
            worst = max(worst, ne + ex * kk / num_experts)
        return worst

    if k is None:
        k = 1
        budget = _budget_bytes(cost)
        while k < num_experts and per_rank_bytes(min(num_experts, k * 2)) <= budget:
            k *= 2
    k = min(k, num_experts)
    nbytes = per_rank_bytes(k)
    stall, t_snap = _per_iter_stall(cost, nbytes)
    return PolicyModel(spec=spec, cost=cost, period_iters=1, stall_s=stall, t_snapshot_s=t_snap,
                       checkpoint_bytes=nbytes, knobs={"k": k},
                       lossy_staleness_iters=(num_experts / k - 1) / 2)


def selective_budgets(cost: CostModel) -> tuple[float, float]:
    """``(B_local, B_remote)`` per rank as the runtime derives them (``SelectivePolicy.config_from_flags``):
    ``B_local = d2h_bandwidth × T_iter``, ``B_remote = _budget_bytes`` (smaller where the replicas bound it)."""
    return cost.config.hardware.d2h_bandwidth * cost.iteration.t_iter_s, _budget_bytes(cost)


def selective_model(cost: CostModel, spec: PolicySpec) -> PolicyModel:
    """MoEtion: non-expert state every iteration, then ``S_total = B/C_expert`` experts (§4.2–4.3) from
    the remaining budget, the most at-risk first (round robin when popularity is uniform): the local snapshot
    from ``B_local``, the replicas from ``B_remote`` (:func:`selective_budgets`). A lost node comes back from
    its replicas, so the replicated experts set the staleness."""
    local_budget, remote_budget = selective_budgets(cost)
    worst_stale, worst_local, worst_remote = 0.0, 0.0, 0.0
    knobs: dict = dict.fromkeys(("experts_per_iter", "replicated_per_iter", "experts_per_rank"))  # the stalest stage
    for s in range(cost.config.parallel.pp):
        ops = cost.rank_operators(s)
        experts = [o for o in ops if o.op.is_expert]
        ne = sum(o.bytes_full for o in ops if not o.op.is_expert)
        if not experts:
            worst_local, worst_remote = max(worst_local, ne), max(worst_remote, ne)
            continue

        def experts_within(budget: float) -> int:
            # at least one: the runtime never plans fewer (a budget derived from the bandwidth is floored at the
            # non-experts and one expert; a given one below that is refused), so the stall below charges the rest
            return max(1, min(len(experts), moetion_experts_per_iter(max(0.0, budget - ne), experts[0].bytes_full)))

        s_local, s_remote = experts_within(local_budget), experts_within(remote_budget)
        s_remote = min(s_remote, s_local)  # the replicas carry experts of the local snapshot only
        worst_local = max(worst_local, ne + s_local * experts[0].bytes_full)
        worst_remote = max(worst_remote, ne + s_remote * experts[0].bytes_full)
        stale = (len(experts) / s_remote - 1) / 2
        if knobs["experts_per_rank"] is None or stale > worst_stale:
            knobs = {"experts_per_iter": s_local, "replicated_per_iter": s_remote, "experts_per_rank": len(experts)}
        worst_stale = max(worst_stale, stale)
    stall, t_snap = _per_iter_stall(cost, worst_local, worst_remote)
    return PolicyModel(spec=spec, cost=cost, period_iters=1, stall_s=stall, t_snapshot_s=t_snap,
                       checkpoint_bytes=worst_local, knobs=knobs,
                       lossy_staleness_iters=worst_stale)
