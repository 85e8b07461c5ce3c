"""Sparse checkpoint window size: MoEvement §3.5, Algorithm 1 (``FindWindowSize``).

The paper assumes every operator has the same size (``S_Master + S_Optim`` when active, ``S_Compute``
when frozen) and stops the search at two active operators (``while O_Active > 2``). Real models mix
large dense layers, embeddings and small experts, so this version takes per-operator sizes *in
checkpoint order* and checks the busiest iteration of the window it would generate: in slice ``i`` the
operators of that slice are FULL and every later operator is COMPUTE (``GenerateSchedule``, lines 19-29).
It searches down to one active operator per iteration (the paper's bound of 2 has no justification and
turns a fitting window of one operator per iteration into a stalling one). With uniform sizes the result
equals the paper's.

The budget is one rank's snapshot bytes per iteration (:func:`snapshot_copy_bandwidth` × ``T_iter``): the
runtime's policies (``sparse.py``, ``selective.py``) and the simulator (``moe_ft/sim/policies.py``) both take
it from :func:`snapshot_copy_bandwidth`, so the planner plans the window the runtime picks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence


def snapshot_copy_bandwidth(*, snapshot_bandwidth: float, replication_bandwidth: float = 0.0,
                            num_replicas: int = 0) -> float:
    """Bytes per second of ``T_iter`` one rank's snapshots may take without their copies falling behind.

    The device-to-host copy moves them at ``snapshot_bandwidth`` (MoEvement Alg. 1, line 14: ``ckpt_size /
    B_PCIe <= T_Iter``). When the snapshots are replicated to ``num_replicas`` peers and the network bytes/s a
    rank may spend on its replicas is known (``replication_bandwidth``, MoEtion §4.2's ``B_remote = BW_net ×
    T_iter``, spent over every peer), each snapshot must also leave the rank ``num_replicas`` times within the
    iteration: the bound is the smaller of the two. ``replication_bandwidth`` 0 (unknown, unlimited) or no
    replicas: the device-to-host link alone, as MoEvement's Alg. 1 has it.
    """
    if snapshot_bandwidth <= 0:
        raise ValueError(f"snapshot bandwidth must be positive bytes/s, got {snapshot_bandwidth}")
    if replication_bandwidth < 0 or num_replicas < 0:
        raise ValueError(f"replication bandwidth and replica count must be >= 0, got {replication_bandwidth} "
                         f"and {num_replicas}")
    if num_replicas and replication_bandwidth:
        return min(snapshot_bandwidth, replication_bandwidth / num_replicas)
    return snapshot_bandwidth


def flags_copy_bandwidth(snapshot_bandwidth: float, replication=None) -> float:
    """:func:`snapshot_copy_bandwidth` for ``--ft-snapshot-bandwidth`` and the replication flags
    (``replication``: a config with ``replication_bandwidth`` and ``replicas``, ``--ft-replication-bandwidth``
    and ``--ft-replicas``; ``None``: no replicas)."""
    if replication is None:
        return snapshot_copy_bandwidth(snapshot_bandwidth=snapshot_bandwidth)
    return snapshot_copy_bandwidth(snapshot_bandwidth=snapshot_bandwidth,
                                   replication_bandwidth=replication.replication_bandwidth,
                                   num_replicas=replication.replicas)

@dataclass(frozen=True)
class WindowChoice:
    """``window``: W_sparse iterations; ``num_active``: operators FULL per iteration (the last slice may
    hold fewer); ``peak_bytes``: bytes of the busiest iteration; ``fits``: whether that iteration's copy
    time ``peak_bytes / bandwidth`` fits in ``t_iter`` (if even one active operator does not fit, the
    window is the number of operators and the snapshot stalls)."""

    window: int
    num_active: int
    peak_bytes: int
    fits: bool


def window_peak_bytes(bytes_full: Sequence[int], bytes_compute: Sequence[int], num_active: int) -> int:
    """Bytes of the busiest iteration of the schedule with ``num_active`` FULL operators per slice.

    Operators are given in checkpoint order; slice ``i`` holds operators ``[i*a, (i+1)*a)``.
    """
    n = len(bytes_full)
    if len(bytes_compute) != n:
        raise ValueError("bytes_full and bytes_compute must have one entry per operator")
    if not 1 <= num_active <= max(n, 1):
        raise ValueError(f"num_active must be in [1, {n}], got {num_active}")
    full_prefix = [0, *accumulate(bytes_full)]
    compute_prefix = [0, *accumulate(bytes_compute)]
    peak = 0
    for start in range(0, n, num_active):
        end = min(start + num_active, n)
        nbytes = (full_prefix[end] - full_prefix[start]) + (compute_prefix[n] - compute_prefix[end])
        peak = max(peak, nbytes)
    return peak


def find_window_size(
    bytes_full: Sequence[int],
    bytes_compute: Sequence[int],
    *,
    bandwidth_bytes_per_s: float,
    t_iter_s: float,
) -> WindowChoice:
    """Smallest window whose busiest snapshot fits in one iteration (MoEvement Alg. 1, ``FindWindowSize``):
    ``peak_bytes <= bandwidth_bytes_per_s × t_iter_s``, the bandwidth from :func:`snapshot_copy_bandwidth`.

    Starts with every operator active and makes one fewer active per step, as the paper does.
    """
    if bandwidth_bytes_per_s <= 0 or t_iter_s <= 0:
        raise ValueError("bandwidth and iteration time must be positive")
    n = len(bytes_full)
    if n == 0:
        raise ValueError("no operators to schedule")
    budget = bandwidth_bytes_per_s * t_iter_s
    for num_active in range(n, 0, -1):
        peak = window_peak_bytes(bytes_full, bytes_compute, num_active)
        if peak <= budget:
            return WindowChoice(math.ceil(n / num_active), num_active, peak, True)
    return WindowChoice(n, 1, window_peak_bytes(bytes_full, bytes_compute, 1), False)
