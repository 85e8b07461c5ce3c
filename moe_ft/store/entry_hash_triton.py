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

import numpy as np
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
    def _store_block_sums(partial_ptr, block, w, i, inside, K0: tl.constexpr, S0: tl.constexpr,
                          K1: tl.constexpr, S1: tl.constexpr, BLOCK: tl.constexpr):
        # both lanes' sum over the block's words ``w`` (indices ``i`` mod 2^32, ``inside`` the valid ones),
        # widened to int64 so that no reduction wraps, into ``partial[block]``
        x0 = _fmix32(w ^ (i * tl.full((), K0, tl.uint32) + tl.full((), S0, tl.uint32)))
        x1 = _fmix32(w ^ (i * tl.full((), K1, tl.uint32) + tl.full((), S1, tl.uint32)))
        zero = tl.zeros((BLOCK,), dtype=tl.int64)
        tl.store(partial_ptr + block * 2, tl.sum(tl.where(inside, x0.to(tl.int64), zero), axis=0))
        tl.store(partial_ptr + block * 2 + 1, tl.sum(tl.where(inside, x1.to(tl.int64), zero), axis=0))

    @triton.jit
    def _lane_sums_kernel(words_ptr, partial_ptr, n_words, K0: tl.constexpr, S0: tl.constexpr,
                          K1: tl.constexpr, S1: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n_words
        w = tl.load(words_ptr + offs, mask=inside, other=0).to(tl.uint32, bitcast=True)
        i = (offs & 0xFFFFFFFF).to(tl.uint32)  # the word index mod 2^32
        _store_block_sums(partial_ptr, block, w, i, inside, K0, S0, K1, S1, BLOCK)

    @triton.jit
    def _table_lane_sums_kernel(addr_ptr, dst_ptr, nwords_ptr, first_ptr, blk_tensor_ptr, blk_start_ptr,
                                partial_ptr, num_blocks, K0: tl.constexpr, S0: tl.constexpr, K1: tl.constexpr,
                                S1: tl.constexpr, BLOCK: tl.constexpr, COPY: tl.constexpr):
        # block b hashes words [start, start + BLOCK) of tensor t = blk_tensor[b], whose word j has the index
        # first[t] + j in its entry; the tensor's address comes from a table (one launch for all). COPY: the
        # words are also stored at dst[t] (0: not copied), from the registers that hash them. A program takes
        # blocks b = its id, + the grid's size, ... (a grid smaller than the blocks keeps SMs free)
        for block in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            t = tl.load(blk_tensor_ptr + block)
            start = tl.load(blk_start_ptr + block)
            words_ptr = tl.load(addr_ptr + t).to(tl.pointer_type(tl.int32))
            n_words = tl.load(nwords_ptr + t)
            first = tl.load(first_ptr + t)
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            inside = offs < n_words
            raw = tl.load(words_ptr + offs, mask=inside, other=0)
            if COPY:
                dst = tl.load(dst_ptr + t)
                n_copied = tl.where(dst != 0, n_words, 0)
                tl.store(dst.to(tl.pointer_type(tl.int32)) + offs, raw, mask=offs < n_copied)
            w = raw.to(tl.uint32, bitcast=True)
            i = ((offs + first) & 0xFFFFFFFF).to(tl.uint32)
            _store_block_sums(partial_ptr, block, w, i, inside, K0, S0, K1, S1, BLOCK)


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


def tableable(tensor: torch.Tensor) -> bool:
    """Whether :class:`TensorTable` can hash ``tensor`` in place: contiguous, whole 32-bit words, 4-byte
    aligned (others go through :func:`device_lane_sums`)."""
    return tensor.is_contiguous() and tensor.nbytes % 4 == 0 and tensor.data_ptr() % 4 == 0


class TensorTable:
    """One kernel launch for the lane sums of many tensors (a snapshot's entries, ~200 tensors): each
    tensor's word ``j`` has the index ``first_index + j`` in its entry (the tensor's byte offset / 4), so
    the sums are the tensor's share of its entry's digest. Built once per set of tensors (the tables live
    on the device); :meth:`launch` queues the kernel on the current stream without synchronizing.
    Tensors must be :func:`tableable` and keep their storage while the table is used."""

    def __init__(self, tensors: list[torch.Tensor], first_indices: list[int], block: int = BLOCK) -> None:
        if not tensors:
            raise ValueError("TensorTable needs at least one tensor")
        _require_runnable(tensors[0])
        for t in tensors:
            if not tableable(t):
                raise ValueError(f"TensorTable takes contiguous, 4-byte aligned tensors of whole words, got "
                                 f"{t.dtype} {tuple(t.shape)} at {t.data_ptr():#x}")
        device = tensors[0].device
        nwords = np.array([t.nbytes // 4 for t in tensors], dtype=np.int64)
        counts = np.maximum(-(-nwords // block), 0)
        blk_tensor = np.repeat(np.arange(len(tensors), dtype=np.int64), counts)
        first_blk = np.concatenate([[0], np.cumsum(counts)[:-1]])
        blk_start = (np.arange(blk_tensor.size, dtype=np.int64) - np.repeat(first_blk, counts)) * block

        def dev(a) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        self.tensors = list(tensors)  # keeps the storages alive while their addresses are in the table
        self.block = block
        self.num_blocks = int(blk_tensor.size)
        self._addr = dev([t.data_ptr() for t in tensors])
        self._nwords, self._first = dev(nwords), dev(first_indices)
        self._blk_tensor, self._blk_start = dev(blk_tensor), dev(blk_start)
        self._partial = torch.empty((max(self.num_blocks, 1), 2), dtype=torch.int64, device=device)
        self._out = torch.empty((len(tensors), 2), dtype=torch.int64, device=device)

    def launch(self, dst: torch.Tensor | None = None, programs: int = 0) -> torch.Tensor:
        """int64 ``[len(tensors), 2]``: each tensor's lane sums (mod 2^32), on the device, queued on the
        current stream. The result buffer is reused by the next launch.

        ``dst``: int64 addresses, one per tensor, on the tensors' device: the kernel also copies each tensor's
        bytes there (0: that tensor is hashed only), from the registers it hashes them in -- a device-to-host
        copy by the SMs when an address is of page-locked host memory mapped for the device. ``programs``: at
        most this many programs, each taking every ``programs``-th block (0: one program per block)."""
        if dst is not None and (dst.dtype != torch.int64 or tuple(dst.shape) != (len(self.tensors),)
                                or dst.device != self._addr.device):
            raise ValueError(f"TensorTable.launch: dst must be {len(self.tensors)} int64 addresses on "
                             f"{self._addr.device}, got {dst.dtype} {tuple(dst.shape)} on {dst.device}")
        if programs < 0:
            raise ValueError(f"TensorTable.launch: programs must be >= 0, got {programs}")
        self._out.zero_()
        if self.num_blocks:
            (k0, s0), (k1, s1) = KEYS
            grid = min(programs, self.num_blocks) if programs else self.num_blocks
            _table_lane_sums_kernel[(grid,)](
                self._addr, self._addr if dst is None else dst, self._nwords, self._first, self._blk_tensor,
                self._blk_start, self._partial, self.num_blocks, K0=k0, S0=s0, K1=k1, S1=s1, BLOCK=self.block,
                COPY=dst is not None)
            self._out.index_add_(0, self._blk_tensor, self._partial[:self.num_blocks])
        return self._out.bitwise_and_(MASK)


def device_lane_sums(tensor: torch.Tensor, first_index: int) -> torch.Tensor:
    """int64 ``[h_0, h_1]`` of ``tensor``'s bytes (the last word zero-padded) whose first word has index
    ``first_index``, on its device without synchronizing: for the tensors :class:`TensorTable` does not take."""
    _require_runnable(tensor)
    data = byte_view(tensor)
    words, tail = split_words(data)
    sums = torch.zeros(2, dtype=torch.int64, device=data.device)
    if words.numel():
        sums = TensorTable([words], [first_index]).launch()[0].clone()
    if tail.numel():
        sums = (sums + lane_sums(tail, first_index=first_index + words.numel())) & MASK
    return sums


def finish(digest: torch.Tensor) -> bytes:
    """The 16-byte digest from :func:`device_digest`'s tensor (synchronizes with its stream)."""
    nbytes, *sums = digest.tolist()
    return pack(nbytes, sums)
