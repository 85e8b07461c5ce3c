"""Analytic ETTR of each policy at one MTBF, with the knob choices the papers make.

Every policy's recovery time is affine in where the failure strikes: ``R = A_s + U·B_s`` with ``U``
uniform on [0, 1) and the failed stage ``s`` uniform (every stage has the same number of ranks). So the
expected recovery and the renewal ETTR (:func:`moe_ft.sim.formulas.ettr_renewal`, exact when failures are
Poisson and a failure during a recovery restarts it) have closed forms:
``E[R] = mean_s(A_s + B_s/2)`` and ``E[e^{R/M}] = mean_s e^{A_s/M}·(e^{B_s/M} − 1)/(B_s/M)``.
We report both the renewal ETTR and MoEvement's first-order formula (§2.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.formulas import daly_interval_s, ettr_first_order
from moe_ft.sim.policies import (
    PolicyModel,
    PolicySpec,
    _phase_times,
    dense_model,
    dense_stall_curve,
    pec_model,
    selective_model,
    sparse_model,
)

MAX_DENSE_INTERVAL = 100_000


@dataclass(frozen=True)
class PolicyResult:
    """What the model predicts for one policy at one MTBF (JSON-serialisable except ``model``)."""

    policy: str
    kind: str
    mtbf_s: float
    knobs: dict
    interval: int  # iterations between checkpoints (1: every iteration)
    window: int  # iterations a complete recovery point spans (dense: 1)
    t_iter_s: float
    t_snapshot_s: float  # copy time of one checkpoint, both phases (overlapped with training)
    t_ckpt_s: float  # stall per checkpoint (MoC eq. 10): T_ckpt of the ETTR formula
    overhead: float  # T_ckpt / (T_iter · interval)
    expected_recovery_s: float
    ettr: float  # renewal model (failures during recovery included)
    ettr_first_order: float  # MoEvement §2.4 formula
    plt: float  # steady-state proportion of lost expert updates (lossy policies; 0 = exact)
    checkpoint_bytes: float  # per rank, largest snapshot
    model: PolicyModel = field(repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "model"}
        d["mtbf_s"] = self.mtbf_s
        return d


def recovery_affine(pm: PolicyModel) -> list[tuple[float, float]]:
    """``(A_s, B_s)`` per stage: ``R = A_s + U·B_s``."""
    out = []
    for s in range(pm.cost.config.parallel.pp):
        a = pm.recovery_s(0.0, s)
        if pm.spec.kind in ("pec", "selective"):
            b = pm.t_iter_s
        else:
            b = pm.recovery_s(float(pm.period_iters), s) - a
        out.append((a, b))
    return out


def _mean_exp(pairs: list[tuple[float, float]], mtbf_s: float) -> float:
    total = 0.0
    for a, b in pairs:
        x = b / mtbf_s
        total += math.exp(a / mtbf_s) * (math.expm1(x) / x if x > 0 else 1.0)
    return total / len(pairs)


def _result(pm: PolicyModel, mtbf_s: float) -> PolicyResult:
    pairs = recovery_affine(pm)
    expected = sum(a + b / 2 for a, b in pairs) / len(pairs)
    interval = pm.interval
    t_ckpt = pm.overhead * interval * pm.t_iter_s
    plt = (pm.t_iter_s / mtbf_s) * pm.lossy_staleness_iters
    return PolicyResult(
        policy=pm.spec.label, kind=pm.spec.kind, mtbf_s=mtbf_s, knobs=dict(pm.knobs), interval=interval,
        window=pm.period_iters if pm.spec.kind == "sparse" else 1, t_iter_s=pm.t_iter_s,
        t_snapshot_s=pm.t_snapshot_s, t_ckpt_s=t_ckpt, overhead=pm.overhead, expected_recovery_s=expected,
        ettr=1.0 / ((1.0 + pm.overhead) * _mean_exp(pairs, mtbf_s)),
        ettr_first_order=ettr_first_order(t_ckpt, pm.t_iter_s, interval, expected, mtbf_s),
        plt=plt, checkpoint_bytes=pm.checkpoint_bytes, model=pm,
    )


def choose_dense_interval(cost: CostModel, spec: PolicySpec, mtbf_s: float) -> int:
    """Dense interval by the spec's rule: fixed, ``cap`` (smallest with overhead <= max_overhead, as
    CheckFreq is configured in MoEvement §5.2), ``daly`` (FGCS 2006, iterated because the stall depends
    on the interval) or ``oracle`` (sweep for the highest renewal ETTR, as MoEvement does for Gemini)."""
    if spec.interval.isdigit():
        return int(spec.interval)
    t_iter = cost.iteration.t_iter_s
    if spec.interval == "daly":
        # Daly's δ is a fixed cost per checkpoint; ours shrinks as the interval hides the second phase,
        # so take the cost of a checkpoint that nothing hides: the stall at interval 1.
        delta = float(dense_stall_curve(cost, spec, np.array([1.0]))[0])
        return max(1, round(daly_interval_s(delta, mtbf_s) / t_iter))
    k_max = int(min(MAX_DENSE_INTERVAL, max(2, math.ceil(4 * mtbf_s / t_iter))))
    ks = np.arange(1, k_max + 1, dtype=float)
    stall = dense_stall_curve(cost, spec, ks)
    overhead = stall / (ks * t_iter)
    if spec.interval == "cap":
        ok = np.nonzero(overhead <= spec.max_overhead)[0]
        if len(ok) == 0:
            raise ValueError(f"no dense interval up to {k_max} keeps overhead <= {spec.max_overhead:.1%}")
        return int(ks[ok[0]])
    d2h, second = _phase_times(cost, max(cost.snapshot_bytes(s, "full") for s in range(cost.config.parallel.pp)),
                               spec.store)
    base = dense_model(cost, spec, 1).restart_load_s() + d2h + second  # restart, load, commit latency
    lam_p = (ks * t_iter + stall) / mtbf_s
    log_ettr = -np.log1p(overhead) - base / mtbf_s - np.log(np.expm1(lam_p) / lam_p)
    return int(ks[int(np.argmax(log_ettr))])


def build_model(cost: CostModel, spec: PolicySpec, mtbf_s: float) -> PolicyModel:
    """The policy with its knobs chosen for this MTBF."""
    if spec.kind == "dense":
        return dense_model(cost, spec, choose_dense_interval(cost, spec, mtbf_s))
    if spec.kind == "sparse":
        return sparse_model(cost, spec)
    if spec.kind == "selective":
        return selective_model(cost, spec)
    if spec.k.isdigit():
        return pec_model(cost, spec, int(spec.k))
    pm = pec_model(cost, spec)
    if spec.k == "dynamic":  # steady state of MoC Dynamic-K: double K until PLT ≈ λ·T_iter·staleness fits
        while (pm.t_iter_s / mtbf_s) * pm.lossy_staleness_iters > spec.plt_budget \
                and pm.knobs["k"] < cost.config.model.num_experts:
            pm = pec_model(cost, spec, pm.knobs["k"] * 2)
    return pm


def evaluate(cost: CostModel, spec: PolicySpec, mtbf_s: float) -> PolicyResult:
    """Analytic prediction for one policy at one MTBF."""
    if mtbf_s <= 0:
        raise ValueError(f"MTBF must be > 0 seconds, got {mtbf_s}")
    return _result(build_model(cost, spec, mtbf_s), mtbf_s)
