"""Discrete-event simulation of a training run under failures.

The job alternates between *running* (periods of ``period_iters`` iterations costing ``period_wall_s``,
the stall included) and *recovering*. A failure at phase ``φ`` of the period costs
``PolicyModel.recovery_s(φ, stage, segment)``; afterwards the job is back at the iteration it failed in.
Concurrent and cascading failures: with localized recovery, failed stages that touch (the same or adjacent
stages) recover jointly as one contiguous segment, disjoint ones in parallel (MoEvement App. A). A later
failure during a recovery restarts it with every stage failed so far (``localized=runtime``, what moe-ft
does: the new attempt, or the restarted job, re-enters recovery on every rank with the wider scope); in
MoEvement's model (``localized=paper``) only a failure that touches the ongoing recovery restarts it and a
disjoint one recovers in parallel. With global rollback any failure during a recovery restarts it. Lossy policies accumulate
lost expert updates (MoC PLT); ``pec:k=dynamic`` doubles K when the cumulative PLT passes its budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_ft.sim.analytic import build_model
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.failures import FailureEvent
from moe_ft.sim.policies import PolicyModel, PolicySpec, pec_model


@dataclass
class SimResult:
    """Outcome of one simulated run."""

    policy: str
    horizon_s: float
    useful_iters: float
    t_iter_s: float
    num_failures: int
    lost_s: dict = field(default_factory=dict)  # wall seconds by cause: checkpoint, restart, recompute
    tokens_per_iter: int = 0
    final_knobs: dict = field(default_factory=dict)
    plt: float = 0.0  # cumulative proportion of lost expert updates (lossy policies)

    @property
    def ettr(self) -> float:
        return self.useful_iters * self.t_iter_s / self.horizon_s

    @property
    def goodput_tokens_per_s(self) -> float:
        return self.useful_iters * self.tokens_per_iter / self.horizon_s

    def to_dict(self) -> dict:
        return {"policy": self.policy, "ettr": self.ettr, "goodput_tokens_per_s": self.goodput_tokens_per_s,
                "num_failures": self.num_failures, "lost_s": dict(self.lost_s), "plt": self.plt,
                "useful_iters": self.useful_iters, "knobs": dict(self.final_knobs)}


def node_stages(cost: CostModel, node_idx: int) -> set[int]:
    """Pipeline stages with a rank on ``node_idx`` (Megatron rank order: tp fastest, then dp, then pp)."""
    p, g = cost.config.parallel, cost.config.hardware.gpus_per_node
    per_stage = p.tp * p.dp
    first, last = node_idx * g, min((node_idx + 1) * g, p.world_size) - 1
    return set(range(first // per_stage, last // per_stage + 1))


def num_nodes(cost: CostModel) -> int:
    g = cost.config.hardware.gpus_per_node
    return -(-cost.config.parallel.world_size // g)


def _segments(stages: set[int]) -> list[tuple[int, int]]:
    """Contiguous runs of stages as (first, length)."""
    out: list[tuple[int, int]] = []
    for s in sorted(stages):
        if out and s == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def _touches(a: set[int], b: set[int]) -> bool:
    return any(abs(x - y) <= 1 for x in a for y in b)


class Simulator:
    """Simulates one policy (knobs chosen for ``mtbf_s``) against a list of failure events."""

    def __init__(self, cost: CostModel, spec: PolicySpec, mtbf_s: float):
        self.cost = cost
        self.spec = spec
        self.model: PolicyModel = build_model(cost, spec, mtbf_s)
        if spec.kind == "pec" and spec.k == "dynamic":  # start from the fitting K; failures raise it
            self.model = pec_model(cost, spec, spec.k0 or None)

    def _recovery(self, phase: float, stages: set[int]) -> float:
        pm = self.model
        if not pm.localized:
            return pm.recovery_s(phase, min(stages))
        return max(pm.recovery_s(phase, first, length) for first, length in _segments(stages))

    def run(self, events: list[FailureEvent], horizon_s: float) -> SimResult:
        if horizon_s <= 0:
            raise ValueError("horizon_s must be > 0")
        cfg = self.cost.config
        pm = self.model
        res = SimResult(policy=self.spec.label, horizon_s=horizon_s, useful_iters=0.0, t_iter_s=pm.t_iter_s,
                        num_failures=0, tokens_per_iter=cfg.parallel.global_batch_size * cfg.model.seq_length,
                        lost_s={"checkpoint": 0.0, "restart": 0.0, "recompute": 0.0})
        stage_of = {k: node_stages(self.cost, k) for e in events for k in e.nodes}
        t, pos, lost_updates, i = 0.0, 0.0, 0.0, 0
        n = len(events)
        while t < horizon_s:
            end = min(events[i].time_s if i < n else horizon_s, horizon_s)
            if end > t:  # running
                dt = end - t
                res.useful_iters += dt / pm.period_wall_s * pm.period_iters
                res.lost_s["checkpoint"] += dt * pm.stall_s / pm.period_wall_s
                pos = (pos + dt) % pm.period_wall_s
                t = end
            if t >= horizon_s or i >= n:
                break
            # a failure: recover, absorbing failures that strike during the recovery
            phase = pos / pm.period_wall_s * pm.period_iters
            failed = set().union(*(stage_of[k] for k in events[i].nodes))
            rec_end = t + self._recovery(phase, failed)
            restart_part = pm.restart_load_s()
            res.num_failures += 1
            i += 1
            while i < n and events[i].time_s < min(rec_end, horizon_s):
                new = set().union(*(stage_of[k] for k in events[i].nodes))
                t_new = events[i].time_s
                res.num_failures += 1
                i += 1
                if not pm.localized or pm.spec.localized_model == "runtime" or _touches(new, failed):
                    failed |= new
                    rec_end = t_new + self._recovery(phase, failed)
                else:  # disjoint: recovers in parallel with the ongoing one
                    rec_end = max(rec_end, t_new + self._recovery(phase, new))
            down = min(rec_end, horizon_s) - t
            res.lost_s["restart"] += min(down, restart_part)
            res.lost_s["recompute"] += max(0.0, down - restart_part)
            t = rec_end
            if pm.lossy_staleness_iters:
                lost_updates += pm.lossy_staleness_iters
                res.plt = lost_updates / max(res.useful_iters, 1.0)
                if (self.spec.kind == "pec" and self.spec.k == "dynamic" and res.plt > self.spec.plt_budget
                        and pm.knobs["k"] < cfg.model.num_experts):  # MoC Dynamic-K: double K
                    pm = self.model = pec_model(self.cost, self.spec, pm.knobs["k"] * 2)
                    pos = 0.0
        res.final_knobs = dict(pm.knobs)
        return res
