"""Dispatch schedule of the flexible token dispatcher: Lazarus §4.2, Algorithm 1 (lines 1-9), in integers.

Inputs are the all-gathered ``T[e, j]`` (tokens routed to expert ``e`` on rank ``j``) and the replica map
``R[e, j]`` (replicas of ``e`` on rank ``j``), both ``[num_experts, world_size]``; every rank computes the
same integers, so send and receive counts agree without further communication.

1. Capacity. Expert ``e``'s ``t_e = sum_j T[e, j]`` tokens are split over its ``r_e = sum_j R[e, j]``
   replicas: every replica takes ``floor(t_e / r_e)`` and the first ``t_e mod r_e`` replicas (replicas
   numbered in rank order) one more, so ``cap[e, j]`` sums to ``t_e`` exactly. (The paper's ``t_e / r_e``
   is real-valued; this is its integer form.)
2. Local first. Rank ``j`` keeps ``local[e, j] = min(cap[e, j], T[e, j])`` of its own tokens; it has
   residual capacity ``P[e, j] = cap - local`` and excess ``X[e, j] = T - local`` (never both positive).
3. The rest by residual capacity. ``sum_j X[e, j] == sum_j P[e, j]``. Lay the excesses of ranks 0..W-1 on
   a line, and the residual capacities on another; rank ``i`` sends to rank ``j`` the length of the overlap
   of its excess interval with ``j``'s capacity interval. This is the integral solution of Alg. 1 line 7
   (whose proportional split is real-valued): every source sends exactly its excess, every replica
   receives exactly its capacity, and ``i`` never sends to itself through the network.

Rank ``i`` only needs row ``i`` (what it sends) and column ``i`` (what it receives) of the ``[W, E, W]``
count tensor, ``O(E * W)`` work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def _check(tokens_per_expert: torch.Tensor, replicas: torch.Tensor) -> None:
    if tokens_per_expert.dim() != 2 or tokens_per_expert.shape != replicas.shape:
        raise ValueError(
            f"tokens_per_expert and replicas must both be [num_experts, world_size], got "
            f"{tuple(tokens_per_expert.shape)} and {tuple(replicas.shape)}"
        )
    if (tokens_per_expert < 0).any() or (replicas < 0).any():
        raise ValueError("token counts and replica counts must be non-negative")
    orphan = (tokens_per_expert.sum(1) > 0) & (replicas.sum(1) == 0)
    if orphan.any():
        raise ValueError(f"experts {orphan.nonzero().flatten().tolist()} have tokens but no replica in the plan")


def capacity(tokens_per_expert: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """``cap[e, j]``: tokens of expert ``e`` that rank ``j``'s replicas process; ``[E, W]`` int64."""
    t = tokens_per_expert.to(torch.int64)
    r = replicas.to(torch.int64)
    t_e, r_e = t.sum(1, keepdim=True), r.sum(1, keepdim=True)
    q, rem = t_e // r_e.clamp(min=1), t_e % r_e.clamp(min=1)
    first_replica = _exclusive_cumsum(r, 1)
    return q * r + torch.minimum((rem - first_replica).clamp(min=0), r)


@dataclass(frozen=True)
class DispatchSchedule:
    """What rank ``rank`` sends and receives.

    ``send_counts[e, j]``: tokens of expert ``e`` that ``rank`` sends to rank ``j`` (``j == rank``: kept);
    ``recv_counts[j, e]``: tokens of expert ``e`` that ``rank`` receives from rank ``j``; both int64.
    ``input_split_sizes``/``output_split_sizes`` are what ``all_to_all_single`` takes; the send buffer is
    grouped by destination rank then expert, the receive buffer by source rank then expert.
    """

    rank: int
    send_counts: torch.Tensor  # [E, W]
    recv_counts: torch.Tensor  # [W, E]

    @property
    def input_split_sizes(self) -> list[int]:
        return self.send_counts.sum(0).tolist()

    @property
    def output_split_sizes(self) -> list[int]:
        return self.recv_counts.sum(1).tolist()


def _interval_overlap(a_start, a_len, b_start, b_len) -> torch.Tensor:
    lo = torch.maximum(a_start, b_start)
    hi = torch.minimum(a_start + a_len, b_start + b_len)
    return (hi - lo).clamp(min=0)


def _local_excess_residual(tokens_per_expert: torch.Tensor, replicas: torch.Tensor):
    t = tokens_per_expert.to(torch.int64)
    cap = capacity(t, replicas)
    local = torch.minimum(cap, t)
    return local, t - local, cap - local


def dispatch_schedule(tokens_per_expert: torch.Tensor, replicas: torch.Tensor, rank: int) -> DispatchSchedule:
    """Algorithm 1 for one rank. ``tokens_per_expert``, ``replicas``: ``[E, W]`` (the all-gathered counts
    and the placement's replica map); returns the rank's ``DispatchSchedule``."""
    _check(tokens_per_expert, replicas)
    world_size = tokens_per_expert.shape[1]
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    local, excess, residual = _local_excess_residual(tokens_per_expert, replicas)
    x_start, p_start = _exclusive_cumsum(excess, 1), _exclusive_cumsum(residual, 1)
    i = rank
    send = _interval_overlap(x_start[:, i : i + 1], excess[:, i : i + 1], p_start, residual)  # [E, W]
    recv = _interval_overlap(x_start, excess, p_start[:, i : i + 1], residual[:, i : i + 1]).T  # [W, E]
    send[:, i] += local[:, i]
    recv[i, :] += local[:, i]
    return DispatchSchedule(rank, send.contiguous(), recv.contiguous())


def all_send_counts(tokens_per_expert: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """``counts[i, e, j]`` for every pair of ranks, ``[W, E, W]`` -- for tests and small worlds only."""
    _check(tokens_per_expert, replicas)
    local, excess, residual = _local_excess_residual(tokens_per_expert, replicas)
    x_start, p_start = _exclusive_cumsum(excess, 1), _exclusive_cumsum(residual, 1)
    counts = _interval_overlap(
        x_start.T[:, :, None], excess.T[:, :, None], p_start[None, :, :], residual[None, :, :]
    )
    world = tokens_per_expert.shape[1]
    counts[torch.arange(world), :, torch.arange(world)] += local.T
    return counts
