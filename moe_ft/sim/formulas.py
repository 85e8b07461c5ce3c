"""Closed-form pieces of the ETTR model, each as the paper writes it (and, where the paper's form is
inconsistent, the corrected form next to it; ``docs/simulator.md`` explains each correction).

Units: seconds unless a name says ``iters``; ``mtbf_s`` is the job's mean time between failures.
"""

from __future__ import annotations

import math
from typing import Sequence


def _check_pos(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")


def ettr_first_order(t_ckpt_s: float, t_iter_s: float, interval: int, expected_recovery_s: float,
                     mtbf_s: float) -> float:
    """MoEvement §2.4 / App. C: ``1/(1 + T_ckpt/(T_iter·interval)) · 1/(1 + E[R]/MTBF)``.

    ``t_ckpt_s`` is the stall each checkpoint adds (not the overlapped copy time). First order in
    ``E[R]/MTBF``: it ignores failures that strike during a recovery.
    """
    _check_pos(t_iter_s=t_iter_s, interval=interval, mtbf_s=mtbf_s)
    return 1.0 / (1.0 + t_ckpt_s / (t_iter_s * interval)) / (1.0 + expected_recovery_s / mtbf_s)


def ettr_renewal(overhead: float, recovery_samples_s: Sequence[float], mtbf_s: float) -> float:
    """ETTR of a renewal process: ``1 / ((1 + overhead) · E[exp(R/MTBF)])``.

    Failures are Poisson in wall-clock time; a failure during a recovery restarts it (so a recovery of
    length R takes ``(e^{λR} - 1)/λ`` on average); ``recovery_samples_s`` are equally likely values of R
    (one per position of the failure within the checkpoint period). For dense checkpointing with
    ``R = R0 + U·(τ + δ)`` this is exactly Daly's complete model, see :func:`daly_wall_fraction`.
    ``exp(x) ≈ 1 + x`` gives back the first-order factor of :func:`ettr_first_order`.
    """
    _check_pos(mtbf_s=mtbf_s)
    if not recovery_samples_s:
        raise ValueError("need at least one recovery sample")
    mean_exp = math.fsum(math.exp(r / mtbf_s) for r in recovery_samples_s) / len(recovery_samples_s)
    return 1.0 / ((1.0 + overhead) * mean_exp)


def daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints (J. T. Daly, "A higher order
    estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, eq. 37):

    ``τ = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ`` for ``δ < 2M``, else ``τ = M``;
    ``δ`` is the time one checkpoint costs the job (its stall) and ``M`` the MTBF.
    """
    _check_pos(mtbf_s=mtbf_s)
    if delta_s < 0:
        raise ValueError("delta_s must be >= 0")
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def young_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Young's first-order interval ``sqrt(2δM)`` (Young 1974), the leading term of Daly's."""
    _check_pos(mtbf_s=mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_wall_fraction(tau_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful fraction of wall time in Daly's complete model (FGCS 2006, eq. 13):
    ``T_s/T_w = τ / (M·e^{R/M}·(e^{(τ+δ)/M} − 1))``."""
    _check_pos(tau_s=tau_s, mtbf_s=mtbf_s)
    m = mtbf_s
    return tau_s / (m * math.exp(restart_s / m) * math.expm1((tau_s + delta_s) / m))


def snapshot_stall_s(t_snapshot_s: float, t_overlap_s: float) -> float:
    """MoC eq. 10: ``O_save = max(0, T_snapshot − T_F&B)``: the part of a snapshot the next forward and
    backward pass cannot hide."""
    return max(0.0, t_snapshot_s - t_overlap_s)


def moc_total_overhead_s(o_save_s: float, i_total: int, i_ckpt: int, faults_per_iter: float,
                         o_restart_s: float, t_iter_s: float) -> float:
    """MoC eq. 11–13 with consistent units: ``O_save·I_total/I_ckpt + λ·I_total·(O_restart + I_ckpt/2·T_iter)``.

    The paper adds ``I_ckpt/2`` (iterations) to ``O_restart`` (seconds); the lost progress is
    ``I_ckpt/2`` iterations, i.e. ``I_ckpt/2 · T_iter`` seconds. ``faults_per_iter`` is eq. 11's λ.
    """
    _check_pos(i_total=i_total, i_ckpt=i_ckpt, t_iter_s=t_iter_s)
    n_fault = faults_per_iter * i_total  # eq. 11
    return o_save_s * i_total / i_ckpt + n_fault * (o_restart_s + i_ckpt / 2 * t_iter_s)


def moc_overhead_per_iter_s(o_save_s: float, i_ckpt: int, faults_per_iter: float, t_iter_s: float) -> float:
    """Left/right side of MoC eq. 16 (per iteration, O_restart cancelled, units fixed as above)."""
    _check_pos(i_ckpt=i_ckpt, t_iter_s=t_iter_s)
    return o_save_s / i_ckpt + faults_per_iter * i_ckpt / 2 * t_iter_s


def moc_beats_full(o_save_moc_s: float, i_ckpt_moc: int, o_save_full_s: float, i_ckpt_full: int,
                   faults_per_iter: float, t_iter_s: float) -> bool:
    """MoC eq. 14–16: partial checkpointing has lower total overhead than full checkpointing."""
    return (moc_overhead_per_iter_s(o_save_moc_s, i_ckpt_moc, faults_per_iter, t_iter_s)
            < moc_overhead_per_iter_s(o_save_full_s, i_ckpt_full, faults_per_iter, t_iter_s))


def moetion_wasted_s(t_ckpt_s: float, t_retrieval_s: float, interval: int, t_iter_s: float) -> float:
    """MoEtion §7.2: time lost per failure ``T_ckpt + T_retrieval + (f_ckpt/2)·T_iteration``; the paper's
    ``f_ckpt`` is an interval in iterations (not a frequency)."""
    return t_ckpt_s + t_retrieval_s + interval / 2 * t_iter_s


def moetion_experts_per_iter(budget_bytes: float, expert_bytes: float) -> int:
    """MoEtion §4.2–4.3: ``S_total = B / C_expert`` (floored: a partial expert cannot be saved)."""
    _check_pos(expert_bytes=expert_bytes)
    return max(0, math.floor(budget_bytes / expert_bytes))
