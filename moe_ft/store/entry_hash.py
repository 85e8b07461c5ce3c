"""``mfh64``: an entry checksum computed where the bytes are, in parallel blocks.

A snapshot entry's bytes are hashed on the device that holds them (a Triton kernel on CUDA,
``entry_hash_triton.py``), so that the trainer's CPU never reads a payload byte to checksum it; the node
agent or a recovery verifies the same digest on the host with the reference below (NumPy on the CPU,
PyTorch on other devices). The function is defined here, once, and the kernel must equal this reference bit
for bit.

Definition. Take the entry's ``n`` bytes as little-endian 32-bit words ``w_0 .. w_{m-1}`` (``m = ceil(n /
4)``, the last word zero-padded). For the two lanes ``l = 0, 1``::

    x_i   = fmix32(w_i XOR ((i * K_l + S_l) mod 2^32))        # i taken mod 2^32
    h_l   = (sum_i x_i) mod 2^32

``fmix32`` is MurmurHash3's 32-bit finalizer (xorshift-multiply, a bijection on 32-bit words). The digest
is 16 bytes: ``n`` as uint64, then ``h_0`` and ``h_1`` as uint32, little-endian.

Why this shape. A sum is order-free, so any split into blocks (one per GPU program, one per CPU chunk) gives
the same digest, and the block sums combine with one more sum. Position enters through the key XORed into
each word, so moved or swapped words change the digest. A change confined to one 32-bit word -- every
single-bit flip, every torn byte -- always changes both lanes: the key XOR and ``fmix32`` are bijections,
so exactly one term of each sum changes, and a sum mod 2^32 with one changed term changes. Other
corruptions collide with probability about 2^-64 for the two independent lanes. The length is part of the
digest, so a truncated entry never matches. It is an integrity check against hardware and software faults,
not a cryptographic hash: it offers nothing against a forger.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import torch

try:  # the C build of the sums below (setup.py's optional extension; without it, the NumPy reference)
    import moe_ft.store._mfh64 as _native
except ImportError:  # pragma: no cover - a machine without a C compiler
    _native = None  # type: ignore[assignment]

ALGO = "mfh64"
MASK = 0xFFFFFFFF
KEYS = ((0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0x165667B1))
"""``(K_l, S_l)`` per lane: odd multipliers (golden-ratio and xxHash primes) and offsets."""
FMIX = (0x85EBCA6B, 0xC2B2AE35)
CHUNK_WORDS = 1 << 16
"""Words hashed per step by the reference (256 KiB): its temporaries stay in cache (1.7 GB/s on one core
here, against 0.76 GB/s with 16 MiB steps)."""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` tensor on its device (no copy for a contiguous tensor)."""
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"{ALGO} hashes dense strided tensors, got layout {tensor.layout}")
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


def split_words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole words as int32, tail word as int64[0 or 1])`` of a flat ``uint8`` tensor: the tail holds the
    last ``n % 4`` bytes, zero-padded, little-endian."""
    whole = data.numel() // 4 * 4
    body = data[:whole]
    if body.numel() and body.storage_offset() % 4:  # a view starting mid-word: align with one copy
        body = body.clone()
    words = body.view(torch.int32)
    rest = data[whole:].to(torch.int64)
    if not rest.numel():
        return words, rest
    shifts = torch.arange(rest.numel(), device=data.device, dtype=torch.int64) * 8
    return words, (rest << shifts).sum().reshape(1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)``, without int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * c) << 16)) & MASK


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 ``x`` in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX[0])
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX[1])
    return x ^ (x >> 16)


_KEY_BASES: list[np.ndarray] = []


def _key_bases() -> list[np.ndarray]:
    """``j * K_l mod 2^32`` for ``j < CHUNK_WORDS``, per lane: the key of word ``b + j`` is this plus the
    chunk's constant ``b * K_l + S_l`` (computed once per process, 256 KiB per lane)."""
    if not _KEY_BASES or _KEY_BASES[0].size != CHUNK_WORDS:
        _KEY_BASES[:] = [np.arange(CHUNK_WORDS, dtype=np.uint32) * np.uint32(k) for k, _ in KEYS]
    return _KEY_BASES


NATIVE = _native is not None
"""The C build of the lane sums is installed (``moe_ft/store/_mfh64.c``): host sums at 7-8 GB/s on one core
instead of ~1 GB/s (``tools/bench/mfh64_host.py``), without the GIL, and :func:`copy_lane_sums`."""


def _lane_sums_host(words: np.ndarray, first_index: int) -> list[int]:
    """The lane sums of host ``words`` (uint32): the C build when installed, else :func:`_lane_sums_numpy`."""
    if _native is not None:
        return list(_native.lane_sums(np.ascontiguousarray(words), first_index))
    return _lane_sums_numpy(words, first_index)


def _lane_sums_numpy(words: np.ndarray, first_index: int) -> list[int]:
    """The lane sums with NumPy's uint32 arithmetic, which wraps mod 2^32 as the definition does (about
    15x the int64 PyTorch path on a CPU), in place in two chunk-sized buffers: the reference the C build
    must equal."""
    sums = [0, 0]
    bases = _key_bases()
    x = np.empty(min(CHUNK_WORDS, words.size), dtype=np.uint32)
    tmp = np.empty_like(x)
    m0, m1 = np.uint32(FMIX[0]), np.uint32(FMIX[1])
    for start in range(0, words.size, CHUNK_WORDS):
        w = words[start:start + CHUNK_WORDS]
        xs, ts = x[:w.size], tmp[:w.size]
        for lane, (k, s) in enumerate(KEYS):
            np.add(bases[lane][:w.size], np.uint32(((first_index + start) * k + s) & MASK), out=xs)
            np.bitwise_xor(xs, w, out=xs)
            np.right_shift(xs, 16, out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            np.multiply(xs, m0, out=xs)
            np.right_shift(xs, 13, out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            np.multiply(xs, m1, out=xs)
            np.right_shift(xs, 16, out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            sums[lane] = (sums[lane] + int(xs.sum(dtype=np.uint64))) & MASK
    return sums


def _lane_sums_torch(flat: torch.Tensor, first_index: int) -> torch.Tensor:
    """The lane sums with int64 PyTorch operations on the words' own device (a tail word on a GPU, where
    :func:`entry_hash_triton.device_digest` must not synchronize)."""
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK_WORDS):
        w = flat[start:start + CHUNK_WORDS].to(torch.int64) & MASK
        i = torch.arange(w.numel(), device=w.device, dtype=torch.int64) + (first_index + start)
        i = i & MASK
        for lane, (k, s) in enumerate(KEYS):
            key = (_mul32(i, k) + s) & MASK
            out[lane] += fmix32(w ^ key).sum()
        out &= MASK
    return out


def lane_sums(words: torch.Tensor, first_index: int = 0) -> torch.Tensor:
    """int64 ``[h_0, h_1]`` (each mod 2^32) of 32-bit ``words`` (any integer dtype; the low 32 bits count)
    whose first word has index ``first_index``; on the words' device, in chunks (NumPy on the CPU)."""
    flat = words.reshape(-1)
    if flat.device.type != "cpu":
        return _lane_sums_torch(flat, first_index)
    host = flat.numpy().astype(np.uint32) if flat.dtype != torch.int32 else flat.numpy().view(np.uint32)
    return torch.tensor(_lane_sums_host(host, first_index), dtype=torch.int64)


def pack(nbytes: int, sums: list[int]) -> bytes:
    """The 16-byte digest of ``nbytes`` bytes whose lane sums are ``sums``."""
    h0, h1 = (int(v) & MASK for v in sums)
    return struct.pack("<QII", nbytes, h0, h1)


def reference_digest(tensor: torch.Tensor) -> bytes:
    """The digest of ``tensor``'s bytes, computed on the tensor's own device (NumPy for a CPU tensor)."""
    return pack(byte_view(tensor).numel(), lane_sums_of(tensor, 0))


def lane_sums_of(tensor: torch.Tensor, first_index: int) -> list[int]:
    """The lane sums of ``tensor``'s bytes (the last word zero-padded) whose first word has index
    ``first_index`` in its entry (a tensor's share of the entry's digest)."""
    data = byte_view(tensor)
    if data.device.type == "cpu":  # NumPy on the bytes in place (a host tensor sealed into a GPU snapshot:
        raw = data.numpy()  # a step counter; each torch operation of the general path costs ~10 us)
        if _native is not None:  # the tail word too
            return list(_native.lane_sums(raw, first_index))
        whole = raw.size // 4 * 4
        host = _lane_sums_host(raw[:whole].view("<u4"), first_index) if whole else [0, 0]
        if whole < raw.size:
            last = _lane_sums_host(np.frombuffer(raw[whole:].tobytes().ljust(4, b"\0"), dtype="<u4"),
                                   first_index + whole // 4)
            host = [(a + b) & MASK for a, b in zip(host, last)]
        return host
    words, tail = split_words(data)
    sums = lane_sums(words, first_index)
    if tail.numel():
        sums = (sums + lane_sums(tail, first_index=first_index + words.numel())) & MASK
    return [int(v) for v in sums.tolist()]


def copy_lane_sums(src: torch.Tensor, dst: torch.Tensor, first_index: int) -> list[int]:
    """Copy host tensor ``src``'s bytes into ``dst`` (a flat ``uint8`` host tensor of the same size: its place
    in a store region) and return their lane sums (the last word zero-padded) as if their first word had
    index ``first_index``, in one pass over the bytes (:data:`NATIVE` only): the snapshot's one copy on a CPU
    node carries its checksum, taken from the live tensor as it is read."""
    if _native is None:
        raise RuntimeError("copy_lane_sums needs moe-ft's C extension (moe_ft/store/_mfh64.c), which was not built")
    data = byte_view(src)
    if data.device.type != "cpu" or dst.device.type != "cpu":
        raise ValueError(f"copy_lane_sums copies host tensors, got {data.device} -> {dst.device}")
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError("copy_lane_sums needs a flat contiguous uint8 destination")
    return list(_native.copy_lane_sums(data.numpy(), dst.numpy(), first_index))


def bytes_lane_sums(data: bytes, first_index: int = 0) -> list[int]:
    """The lane sums of host ``data`` (the last word zero-padded) whose first word has index ``first_index``:
    a header's share of its entry's digest, in one pass."""
    return _lane_sums_host(np.frombuffer(data + bytes(-len(data) % 4), dtype="<u4"), first_index)


def _word_term(word: int, index: int, lane: int) -> int:
    """One word's term of lane ``lane`` (the definition above, in Python integers)."""
    k, s = KEYS[lane]
    x = word ^ ((index * k + s) & MASK)
    x ^= x >> 16
    x = (x * FMIX[0]) & MASK
    x ^= x >> 13
    x = (x * FMIX[1]) & MASK
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=1024)
def words_terms(data: bytes, first_word: int) -> tuple[int, int]:
    """Both lanes' sums (not reduced mod 2^32) of the terms of ``data``'s words (whole words) when its first
    word has index ``first_word``; remembered: the words of an entry header that hold the iteration's digits
    are the same in every entry of a point (:func:`moe_ft.store.codec.sealed_head`)."""
    h0 = h1 = 0
    for j in range(len(data) // 4):
        word = int.from_bytes(data[4 * j:4 * j + 4], "little")
        h0 += _word_term(word, first_word + j, 0)
        h1 += _word_term(word, first_word + j, 1)
    return h0, h1


def zero_word_sums(first_index: int, count: int) -> list[int]:
    """The lane sums of ``count`` zero words starting at word ``first_index`` (an entry's alignment padding
    between tensors, which the device hashes of the tensors leave out)."""
    if count <= 0:
        return [0, 0]
    return _lane_sums_host(np.zeros(count, dtype=np.uint32), first_index)


class Mfh64:
    """Streaming ``mfh64`` over bytes fed in pieces of any length (the ``hashlib`` interface the store's
    codec uses: ``update``, ``digest``, ``digest_size``): the host side of an entry's digest, which a
    reader recomputes to verify an entry whose payload was hashed on the device."""

    digest_size = 16

    def __init__(self) -> None:
        self._sums = [0, 0]
        self._words = 0  # whole words hashed so far
        self._carry = b""  # 0-3 bytes of an unfinished word

    def update(self, buf) -> None:
        view = memoryview(buf).cast("B")
        if self._carry:
            need = 4 - len(self._carry)
            self._carry += bytes(view[:need])
            view = view[need:]
            if len(self._carry) < 4:
                return
            self._add(np.frombuffer(self._carry, dtype="<u4"))
            self._carry = b""
        whole = len(view) // 4 * 4
        if whole:
            self._add(np.frombuffer(view[:whole], dtype="<u4"))
        self._carry = bytes(view[whole:])

    def _add(self, words: np.ndarray) -> None:
        sums = _lane_sums_host(words, self._words)
        self._sums = [(a + b) & MASK for a, b in zip(self._sums, sums)]
        self._words += words.size

    def sums(self) -> list[int]:
        """The lane sums of the whole words fed so far (not the unfinished one)."""
        return list(self._sums)

    def digest(self) -> bytes:
        sums, n = self._sums, self._words * 4
        if self._carry:
            tail = np.frombuffer(self._carry.ljust(4, b"\0"), dtype="<u4")
            sums = [(a + b) & MASK for a, b in zip(sums, _lane_sums_host(tail, self._words))]
            n += len(self._carry)
        return pack(n, sums)
