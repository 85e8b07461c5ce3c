"""Flexible token dispatcher arithmetic (Lazarus §4.2, Algorithm 1), free of process groups.

Interface for the Megatron dispatcher. Per MoE layer and micro-batch, on EP rank ``i``::
    T = all_gather(bincount(expert_idx, minlength=E))          # [W, E] -> transpose to [E, W]
    sched = dispatch_schedule(T, R, i)                          # R: [E, W] replica map from the plan
    perm = build_permutation(expert_idx, sched, config)         # expert_idx: [num_tokens, topk]
    send = permute(hidden, perm, config)                        # [num_slots, hidden], by (dst rank, expert)
    recv = all_to_all_single(send, sched.output_split_sizes, sched.input_split_sizes)
    # recv is grouped by (source rank, expert), chunk sizes sched.recv_counts[j, e];
    # recv_expert_order(sched) reorders it to expert-major (one MLP per held expert takes its rows).
    ... experts (they apply the routing probabilities) ...; un-sort; all_to_all_single back (split sizes swapped)
    out = unpermute(expert_out, perm, ones, config)             # [num_tokens, hidden]: an unweighted sum

Gradients: every replica of expert ``e`` sees a disjoint share of ``e``'s global tokens, so the gradient
of ``e`` is the sum over exactly the ranks with ``R[e, j] > 0`` (the step-4 experts module reduces over
that set); the forward equals standard expert parallelism on the same global batch because every slot is
processed once (no dropping, no padding).

``DispatchConfig.backend`` chooses the implementation explicitly: ``"torch"`` (reference, the default) or
``"triton"`` (kernels in ``permute_triton.py``; never chosen automatically). The schedule is always
computed in PyTorch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from moe_ft.megatron_ext.dispatch.permute_ref import (
    check_routing,
    permute_reference,
    positions_reference,
    unpermute_reference,
)
from moe_ft.megatron_ext.dispatch.schedule import (
    DispatchSchedule,
    _exclusive_cumsum,
    all_send_counts,
    capacity,
    dispatch_schedule,
)

BACKENDS = ("torch", "triton")

FLEXIBLE = "flexible"
"""The ``--moe-token-dispatcher-type`` value that selects the elastic MoE layer and this dispatcher."""


def check_flexible_model(*, expert_tp_size: int = 1, capacity_factor: float | None = None,
                         pad_to_capacity: bool = False, sequential_experts: bool = True) -> None:
    """What the flexible dispatcher serves, a ``ValueError`` naming the flag to change otherwise: whole experts
    on one rank each (expert tensor-parallel size 1), every routed token processed (no dropping, no padding:
    the forward equals standard EP), one MLP per replica (``SequentialMLP``). Checked from the flags at
    parsing (``ElasticConfig.check_args``) and again where the layer is built (the dispatcher, the elastic
    MoE layer)."""
    if expert_tp_size != 1:
        raise ValueError(f"--moe-token-dispatcher-type {FLEXIBLE} runs whole experts on one rank each, not expert "
                         f"tensor parallelism (got size {expert_tp_size}): drop --expert-tensor-parallel-size, or "
                         "use alltoall / allgather")
    if capacity_factor is not None or pad_to_capacity:
        raise ValueError(f"--moe-token-dispatcher-type {FLEXIBLE} never drops or pads tokens: drop "
                         "--moe-expert-capacity-factor (and --ft-capacity-boost, which needs it), or use alltoall / "
                         "allgather")
    if not sequential_experts:
        raise ValueError(f"--moe-token-dispatcher-type {FLEXIBLE} needs SequentialMLP experts (one MLP per replica): "
                         "drop --moe-grouped-gemm")


__all__ = [
    "FLEXIBLE", "check_flexible_model",
    "BACKENDS", "DispatchConfig", "DispatchPermutation", "DispatchSchedule", "all_send_counts", "build_permutation",
    "capacity", "dispatch_schedule", "permute", "recv_expert_order", "unpermute",
]


@dataclass(kw_only=True, frozen=True)
class DispatchConfig:
    """Flexible dispatcher switches."""

    backend: str = "torch"
    """``torch`` (reference) or ``triton`` (explicit opt-in; on CPU needs ``TRITON_INTERPRET=1``)."""
    validate: bool = True
    """Check that the local routing matches the schedule (one ``bincount``; turn off once trusted)."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown dispatch backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class DispatchPermutation:
    """``slot_of_pos[pos]``: slot (``token * topk + k``) in send-buffer row ``pos``; ``pos_of_slot``: inverse.
    Both int64 ``[num_tokens * topk]``."""

    slot_of_pos: torch.Tensor
    pos_of_slot: torch.Tensor
    topk: int


def _triton():
    module = importlib.import_module("moe_ft.megatron_ext.dispatch.permute_triton")
    if not module.HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package: pip install 'moe-ft[triton]'")
    return module


def build_permutation(
    expert_idx: torch.Tensor, schedule: DispatchSchedule, config: DispatchConfig | None = None
) -> DispatchPermutation:
    """Send-buffer order for ``expert_idx: [num_tokens, topk]`` under ``schedule``."""
    config = config or DispatchConfig()
    if config.validate:
        check_routing(expert_idx, schedule.send_counts)
    if config.backend == "triton":
        slot_of_pos, pos_of_slot = _triton().positions_triton(expert_idx, schedule.send_counts)
    else:
        slot_of_pos, pos_of_slot = positions_reference(expert_idx, schedule.send_counts)
    return DispatchPermutation(slot_of_pos, pos_of_slot, expert_idx.shape[1])


def permute(hidden: torch.Tensor, perm: DispatchPermutation, config: DispatchConfig | None = None) -> torch.Tensor:
    """Send buffer ``[num_tokens * topk, hidden]`` from ``hidden: [num_tokens, hidden]``."""
    config = config or DispatchConfig()
    if config.backend == "triton":
        return _triton().permute_triton(hidden, perm.slot_of_pos, perm.topk)
    return permute_reference(hidden, perm.slot_of_pos, perm.topk)


def unpermute(
    expert_out: torch.Tensor, perm: DispatchPermutation, probs: torch.Tensor, config: DispatchConfig | None = None
) -> torch.Tensor:
    """Combine ``expert_out: [num_tokens * topk, hidden]`` (send-buffer order) with ``probs: [num_tokens, topk]``."""
    config = config or DispatchConfig()
    if probs.shape[1] != perm.topk or probs.numel() != perm.pos_of_slot.numel():
        raise ValueError(f"probs must be [num_tokens, {perm.topk}], got {tuple(probs.shape)}")
    if config.backend == "triton":
        return _triton().unpermute_triton(expert_out, perm.pos_of_slot, probs)
    return unpermute_reference(expert_out, perm.pos_of_slot, probs)


def recv_expert_order(schedule: DispatchSchedule) -> torch.Tensor:
    """Index ``[num_recv]`` that reorders the receive buffer (source rank, expert) to (expert, source rank):
    ``expert_major = recv[idx]``; its expert ``e`` block has ``schedule.recv_counts[:, e].sum()`` rows."""
    counts = schedule.recv_counts  # [W, E]
    start = _exclusive_cumsum(counts.reshape(-1), 0).reshape(counts.shape)
    lens = counts.T.reshape(-1)  # chunks in (expert, source rank) order
    shift = start.T.reshape(-1) - _exclusive_cumsum(lens, 0)  # recv start minus expert-major start
    total = int(lens.sum())
    return torch.repeat_interleave(shift, lens, output_size=total) + torch.arange(total, dtype=torch.int64)
