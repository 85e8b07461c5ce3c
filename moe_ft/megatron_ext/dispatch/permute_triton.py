"""Triton kernels for the dispatch permutation; behaviour defined by ``permute_ref.py`` (exact equality).

* ``_positions_kernel`` -- grid ``(E,)``: program ``e`` scans the slots in blocks, ranks the slots routed
  to ``e`` with a running ``tl.cumsum`` (stable: ascending slot order), finds each one's destination rank
  by a binary search over ``e``'s cumulative send counts and writes ``pos_of_slot`` and ``slot_of_pos``.
  ``O(E * num_slots)`` loads, the same order of work as a routing-map based permute.
* ``_gather_kernel`` -- grid ``(num_slots, cdiv(hidden, BLOCK_H))``: send-buffer row ``pos`` copies token
  ``slot_of_pos[pos] // topk``.
* ``_combine_kernel`` -- grid ``(num_tokens, cdiv(hidden, BLOCK_H))``: gathers the ``topk`` expert outputs
  of a token through ``pos_of_slot`` and sums ``probs * out`` in fp32 in order ``k = 0..topk-1`` (a gather,
  so no atomics and a deterministic sum).

The schedule (``schedule.py``) stays in PyTorch: it is ``O(E * W)`` integers, too small to pay
for a kernel. Import this module only through ``arithmetic.py`` (its ``_triton()``); on CPU tensors the kernels need
``TRITON_INTERPRET=1`` set before this module is first imported.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

from moe_ft.megatron_ext.dispatch.schedule import _exclusive_cumsum


def _require_runnable(t: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package: pip install 'moe-ft[triton]'")
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before importing "
            "moe_ft.megatron_ext.dispatch.permute_triton, or use backend='torch'"
        )


if HAVE_TRITON:

    @triton.jit
    def _positions_kernel(
        expert_ptr, cum_send_ptr, buf_offset_ptr, pos_of_slot_ptr, slot_of_pos_ptr,
        num_slots, num_experts, world,
        BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        e = tl.program_id(0)
        # cum_send: [E, W + 1] inclusive-with-leading-zero cumulative send counts of each expert
        carry = tl.zeros((), dtype=tl.int64)
        for start in range(0, num_slots, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            in_range = slot < num_slots
            ids = tl.load(expert_ptr + slot, mask=in_range, other=-1)
            hit = (ids == e).to(tl.int64)
            n = carry + tl.cumsum(hit, axis=0) - hit  # rank of this slot among e's slots
            # largest j in [0, W) with cum_send[e, j] <= n  (binary search; runs of empty ranks skipped)
            lo = tl.zeros((BLOCK,), dtype=tl.int64)
            hi = tl.zeros((BLOCK,), dtype=tl.int64) + world
            for _ in range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                active = hi - lo > 1
                v = tl.load(cum_send_ptr + e * (world + 1) + mid, mask=active & (hit > 0), other=0)
                go_right = v <= n
                lo = tl.where(active & go_right, mid, lo)
                hi = tl.where(active & (~go_right), mid, hi)
            run_start = tl.load(cum_send_ptr + e * (world + 1) + lo, mask=hit > 0, other=0)
            base = tl.load(buf_offset_ptr + lo * num_experts + e, mask=hit > 0, other=0)
            pos = base + n - run_start
            tl.store(pos_of_slot_ptr + slot, pos, mask=hit > 0)
            tl.store(slot_of_pos_ptr + pos, slot.to(tl.int64), mask=hit > 0)
            carry += tl.sum(hit, axis=0)

    @triton.jit
    def _gather_kernel(hidden_ptr, slot_of_pos_ptr, out_ptr, topk, hidden_size, BLOCK_H: tl.constexpr):
        pos = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden_size
        token = tl.load(slot_of_pos_ptr + pos) // topk
        row = tl.load(hidden_ptr + token * hidden_size + cols, mask=mask)
        tl.store(out_ptr + pos.to(tl.int64) * hidden_size + cols, row, mask=mask)

    @triton.jit
    def _combine_kernel(
        expert_out_ptr, pos_of_slot_ptr, probs_ptr, out_ptr, topk, hidden_size,
        BLOCK_H: tl.constexpr, BF16_BITS: tl.constexpr,
    ):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden_size
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(topk):
            pos = tl.load(pos_of_slot_ptr + token * topk + k)
            p = tl.load(probs_ptr + token * topk + k).to(tl.float32)
            y = tl.load(expert_out_ptr + pos * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
            acc = acc + p * y
        if BF16_BITS:
            # fp32 -> bf16 round-to-nearest-even by hand: the interpreter's cast truncates, the GPU's rounds,
            # torch rounds; this matches torch on both (out_ptr is the int16 view of the bf16 output)
            bits = acc.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            out_bits = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
            tl.store(out_ptr + token.to(tl.int64) * hidden_size + cols, out_bits, mask=mask)
        else:
            tl.store(out_ptr + token.to(tl.int64) * hidden_size + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_h(hidden_size: int) -> int:
    return min(1024, triton.next_power_of_2(max(hidden_size, 1)))


def positions_triton(expert_idx: torch.Tensor, send_counts: torch.Tensor, block: int = 128):
    """Same contract as ``permute_ref.positions_reference``."""
    _require_runnable(expert_idx)
    flat = expert_idx.reshape(-1).to(torch.int64).contiguous()
    num_slots = flat.numel()
    num_experts, world = send_counts.shape
    send = send_counts.to(device=flat.device, dtype=torch.int64)
    cum_send = torch.zeros(num_experts, world + 1, dtype=torch.int64, device=flat.device)
    cum_send[:, 1:] = torch.cumsum(send, 1)
    buf_offset = _exclusive_cumsum(send.T.reshape(-1), 0).reshape(world, num_experts).contiguous()
    pos_of_slot = torch.empty(num_slots, dtype=torch.int64, device=flat.device)
    slot_of_pos = torch.empty(num_slots, dtype=torch.int64, device=flat.device)
    if num_slots and num_experts:
        steps = max(1, (world - 1).bit_length() + 1)
        _positions_kernel[(num_experts,)](
            flat, cum_send, buf_offset, pos_of_slot, slot_of_pos, num_slots, num_experts, world,
            BLOCK=block, SEARCH_STEPS=steps,
        )
    return slot_of_pos, pos_of_slot


def permute_triton(hidden: torch.Tensor, slot_of_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Same contract as ``permute_ref.permute_reference``."""
    _require_runnable(hidden)
    hidden = hidden.contiguous()
    out = torch.empty(slot_of_pos.numel(), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    if out.numel():
        block_h = _block_h(hidden.shape[1])
        grid = (slot_of_pos.numel(), triton.cdiv(hidden.shape[1], block_h))
        _gather_kernel[grid](hidden, slot_of_pos.contiguous(), out, topk, hidden.shape[1], BLOCK_H=block_h)
    return out


def unpermute_triton(expert_out: torch.Tensor, pos_of_slot: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Same contract as ``permute_ref.unpermute_reference``."""
    _require_runnable(expert_out)
    num_tokens, topk = probs.shape
    expert_out = expert_out.contiguous()
    out = torch.empty(num_tokens, expert_out.shape[1], dtype=expert_out.dtype, device=expert_out.device)
    if out.numel():
        block_h = _block_h(expert_out.shape[1])
        grid = (num_tokens, triton.cdiv(expert_out.shape[1], block_h))
        bf16 = out.dtype == torch.bfloat16
        _combine_kernel[grid](
            expert_out, pos_of_slot.contiguous(), probs.contiguous(), out.view(torch.int16) if bf16 else out, topk,
            expert_out.shape[1], BLOCK_H=block_h, BF16_BITS=bf16,
        )
    return out
