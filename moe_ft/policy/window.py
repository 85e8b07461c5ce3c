"""Sparse checkpoint window size: MoEvement §3.5, Algorithm 1 (``FindWindowSize``).

The paper assumes every operator has the same size (``S_Master + S_Optim`` when active, ``S_Compute``
when frozen) and stops the search at two active operators (``while O_Active > 2``). Real models mix
large dense layers, embeddings and small experts, so this version takes per-operator sizes *in
checkpoint order* and checks the busiest iteration of the window it would generate: in slice ``i`` the
operators of that slice are FULL and every later operator is COMPUTE (``GenerateSchedule``, lines 19-29).
It searches down to one active operator per iteration (the paper's bound of 2 has no justification and
turns a fitting window of one operator per iteration into a stalling one). With uniform sizes the result
equals the paper's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence


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
    """Smallest window whose busiest snapshot fits in one iteration (MoEvement Alg. 1, ``FindWindowSize``).

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
