"""Pure-PyTorch reference of the dispatch permutation (Lazarus §4.2, Algorithm 1 lines 10-13).

It defines the behaviour the Triton kernels in ``permute_triton.py`` must reproduce exactly.

Slots: routed token copies, ``slot = token * topk + k`` for ``expert_idx: [num_tokens, topk]``. The
``n``-th slot routed to expert ``e`` (slots in ascending order) goes to the destination rank ``j`` whose
run ``[sum_{j'<j} send[e, j'], sum_{j'<=j} send[e, j'])`` contains ``n``. The send buffer is grouped by
destination rank, then expert, then slot order:

    pos = offset[j, e] + n - sum_{j' < j} send[e, j'],   offset = exclusive cumsum of send.T (row-major).

``slot_of_pos[pos]`` (gather index of the send buffer) and ``pos_of_slot[slot]`` (its inverse, used to
combine) are the two outputs; every slot is sent (no dropping, no padding).
"""

from __future__ import annotations

import torch

from moe_ft.megatron_ext.dispatch.schedule import _exclusive_cumsum


def check_routing(expert_idx: torch.Tensor, send_counts: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the local routing matches the schedule's per-expert totals."""
    num_experts = send_counts.shape[0]
    if expert_idx.dim() != 2:
        raise ValueError(f"expert_idx must be [num_tokens, topk], got shape {tuple(expert_idx.shape)}")
    flat = expert_idx.reshape(-1)
    if flat.numel() and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got range [{flat.min()}, {flat.max()}]")
    routed = torch.bincount(flat, minlength=num_experts)
    if not torch.equal(routed.cpu(), send_counts.sum(1).cpu()):
        raise ValueError(
            "routing does not match the all-gathered tokens_per_expert of this rank: "
            f"{routed.tolist()} vs {send_counts.sum(1).tolist()}"
        )


def positions_reference(expert_idx: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_of_pos, pos_of_slot)``, both int64 ``[num_tokens * topk]``."""
    flat = expert_idx.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    num_experts, world = send_counts.shape
    send = send_counts.to(device=flat.device, dtype=torch.int64)
    order = torch.argsort(flat, stable=True)  # sorted position p -> slot
    expert_start = _exclusive_cumsum(torch.bincount(flat, minlength=num_experts), 0)
    chunk_start = (expert_start[:, None] + _exclusive_cumsum(send, 1)).reshape(-1)  # chunk (e, j), sorted space
    buf_offset = _exclusive_cumsum(send.T.reshape(-1), 0).reshape(world, num_experts)  # chunk (j, e), buffer
    p = torch.arange(num_slots, device=flat.device)
    chunk = torch.searchsorted(chunk_start, p, right=True) - 1  # last chunk starting at or before p
    e, j = chunk // world, chunk % world
    pos = buf_offset[j, e] + p - chunk_start[chunk]
    slot_of_pos = torch.empty_like(order)
    slot_of_pos[pos] = order
    pos_of_slot = torch.empty_like(order)
    pos_of_slot[order] = pos
    return slot_of_pos, pos_of_slot


def permute_reference(hidden: torch.Tensor, slot_of_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Send buffer ``[num_tokens * topk, hidden]``: row ``pos`` is ``hidden[slot_of_pos[pos] // topk]``."""
    return hidden.index_select(0, slot_of_pos // topk)


def unpermute_reference(expert_out: torch.Tensor, pos_of_slot: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Combine: ``out[t] = sum_k probs[t, k] * expert_out[pos_of_slot[t * topk + k]]``, accumulated in fp32
    in order ``k = 0..topk-1``; ``expert_out`` is in send-buffer order (after the return all-to-all)."""
    num_tokens, topk = probs.shape
    pos = pos_of_slot.view(num_tokens, topk)
    acc = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    for k in range(topk):
        acc = acc + probs[:, k : k + 1].to(torch.float32) * expert_out.index_select(0, pos[:, k]).to(torch.float32)
    return acc.to(expert_out.dtype)
