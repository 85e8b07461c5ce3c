"""Triton kernel for the ``mfh64`` entry checksum; the function is defined by ``entry_hash.py`` (exact
equality with its PyTorch reference).

``_lane_sums_kernel`` -- grid ``(cdiv(m, BLOCK),)`` over the entry's ``m`` whole 32-bit words: program ``b``
loads its block, computes both lanes' ``fmix32(w_i XOR key_l(i))`` in uint32 arithmetic and writes the
block's two sums (widened to int64, so that no reduction wraps) to ``partial[b]``. One more sum over the
blocks, on the device, gives the lane sums; the tail word (``n % 4`` bytes) is added by the reference, also
on the device. :func:`device_digest` returns the digest as a device tensor without synchronizing, so a
snapshot stream can queue it behind the copy; :func:`finish` turns it into the 16 bytes.

On CPU tensors the kernel needs ``TRITON_INTERPRET=1`` set before this module is first imported (the
tests run it so against the reference).
"""

from __future__ import annotations

import os

import torch

from moe_ft.store.entry_hash import FMIX, KEYS, MASK, byte_view, lane_sums, pack, split_words

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

BLOCK = 4096
"""Words per program (16 KiB): enough loads in flight per SM to run at memory bandwidth."""

if HAVE_TRITON:
    _FMIX0 = tl.constexpr(FMIX[0])  # a jitted function reads only constexpr globals
    _FMIX1 = tl.constexpr(FMIX[1])

    @triton.jit
    def _fmix32(x):
        x = x ^ (x >> 16)
        x = x * tl.full((), _FMIX0, tl.uint32)
        x = x ^ (x >> 13)
        x = x * tl.full((), _FMIX1, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _lane_sums_kernel(words_ptr, partial_ptr, n_words, K0: tl.constexpr, S0: tl.constexpr,
                          K1: tl.constexpr, S1: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n_words
        w = tl.load(words_ptr + offs, mask=inside, other=0).to(tl.uint32, bitcast=True)
        i = (offs & 0xFFFFFFFF).to(tl.uint32)  # the word index mod 2^32
        x0 = _fmix32(w ^ (i * tl.full((), K0, tl.uint32) + tl.full((), S0, tl.uint32)))
        x1 = _fmix32(w ^ (i * tl.full((), K1, tl.uint32) + tl.full((), S1, tl.uint32)))
        zero = tl.zeros((BLOCK,), dtype=tl.int64)
        s0 = tl.sum(tl.where(inside, x0.to(tl.int64), zero), axis=0)
        s1 = tl.sum(tl.where(inside, x1.to(tl.int64), zero), axis=0)
        tl.store(partial_ptr + block * 2, s0)
        tl.store(partial_ptr + block * 2 + 1, s1)


def _require_runnable(t: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the device checksum needs the triton package: pip install 'moe-ft[triton]'")
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton checksum on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "moe_ft.store.entry_hash_triton is imported; use entry_hash.reference_digest on CPU")


def device_digest(tensor: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """int64 ``[nbytes, h_0, h_1]`` of ``tensor``'s bytes, on its device, queued on the current stream
    (no synchronization)."""
    _require_runnable(tensor)
    data = byte_view(tensor)
    words, tail = split_words(data)
    n_blocks = triton.cdiv(words.numel(), block)
    sums = torch.zeros(2, dtype=torch.int64, device=data.device)
    if n_blocks:
        partial = torch.empty((n_blocks, 2), dtype=torch.int64, device=data.device)
        (k0, s0), (k1, s1) = KEYS
        _lane_sums_kernel[(n_blocks,)](words, partial, words.numel(), K0=k0, S0=s0, K1=k1, S1=s1, BLOCK=block)
        sums = partial.sum(dim=0) & MASK
    if tail.numel():
        sums = (sums + lane_sums(tail, first_index=words.numel())) & MASK
    return torch.cat([torch.full((1,), data.numel(), dtype=torch.int64, device=data.device), sums])


def finish(digest: torch.Tensor) -> bytes:
    """The 16-byte digest from :func:`device_digest`'s tensor (synchronizes with its stream)."""
    nbytes, *sums = digest.tolist()
    return pack(nbytes, sums)
