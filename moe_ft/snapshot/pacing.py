"""A snapshot's device-to-host copy in pieces with a short device-side pause between them, so that the training
thread's own small device-to-host reads are not queued behind the whole snapshot.

Why. MoEvement §3.2 overlaps the snapshot copy with the next iteration's computation, and on the device it does:
the copy runs on a side stream and the compute stream never waits for it. But the training thread also reads
from the device: Megatron-Core's MoE token dispatcher copies its token counts to the host in every layer
(``.tolist()``/``.cpu()``), the loss is read with ``.item()``. Those are device-to-host transfers too, and the
GPU's copy engine takes the queued transfers in order, across streams. Measured on an H200
(``tools/bench/gpu_copy_queue.py``): an ``.item()`` issued right after a 700 MB snapshot copy returned after
13.3 ms instead of 0.013 ms, whether the copy was queued as 1, 8 or 64 copies -- queued pieces are still queued.
The first such read of the next iteration therefore waits for the rest of the snapshot (5.6 ms of extra
``cudaStreamSynchronize`` per iteration on the training thread at 685 MB per iteration, docs/benchmarks.md).

How. Queue only one piece at a time: after each piece of at most ``piece_bytes`` the side stream runs a kernel
that waits ``gap_us`` on the device (``torch.cuda._sleep``), and the next piece enters the copy engine's queue
only when it ends. A read that the training thread queues meanwhile goes ahead of the next piece, so it waits
for at most the piece in progress (~0.3 ms for 16 MiB at ~55 GB/s). All pieces and pauses are queued at once
by the training thread: no host thread is involved, and the copy's end event, on which the next optimizer step
waits, is recorded after the last piece as before. The copy takes ``pieces x gap_us`` longer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

DEFAULT_GAP_US = 10.0
"""Device-side pause between pieces. Any pause lets a transfer queued during a piece go first; 10 us keeps the
stretch of a 700 MB copy in 16 MiB pieces at ~0.4 ms."""


@functools.lru_cache(maxsize=64)  # a sparse window's compositions repeat every window
def plan_pieces(sizes: tuple[int, ...], piece_bytes: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Cut a copy of tensors of ``sizes`` bytes (in order) into pieces of at most ``piece_bytes`` bytes each:
    per piece, its ``(tensor index, start byte, end byte)`` slices, in order. A tensor larger than a piece is
    split; small ones share a piece; empty ones are left out (nothing to copy)."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    pieces: list[tuple[tuple[int, int, int], ...]] = []
    current: list[tuple[int, int, int]] = []
    room = piece_bytes
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, room)
            current.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                pieces.append(tuple(current))
                current, room = [], piece_bytes
    if current:
        pieces.append(tuple(current))
    return tuple(pieces)


class CopyPacer:
    """Issues a list of byte copies on the current stream in pieces separated by device-side pauses (module
    docstring). ``pause(us)``: queues the pause on the current stream (default: ``torch.cuda._sleep`` of the
    cycles that last ``us`` on this device, calibrated when the pacer is built)."""

    def __init__(self, piece_bytes: int, gap_us: float = DEFAULT_GAP_US,
                 pause: Callable[[float], None] | None = None) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        if gap_us <= 0:
            raise ValueError(f"gap_us must be > 0, got {gap_us}")
        self.piece_bytes, self.gap_us = piece_bytes, gap_us
        self._pause = pause or _DeviceSleep()
        self.pieces = 0
        """Pieces issued by the last :meth:`copy`."""

    def copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])`` for flat ``uint8`` tensors of equal sizes, non-blocking, in pieces."""
        if len(dst) != len(src) or any(d.numel() != s.numel() for d, s in zip(dst, src)):
            raise ValueError("CopyPacer.copy takes flat byte tensors of equal sizes, pairwise")
        pieces = plan_pieces(tuple(s.numel() for s in src), self.piece_bytes)
        for k, piece in enumerate(pieces):
            if k:
                self._pause(self.gap_us)
            torch._foreach_copy_([dst[i][a:b] for i, a, b in piece], [src[i][a:b] for i, a, b in piece],
                                 non_blocking=True)
        self.pieces = len(pieces)


class _DeviceSleep:
    """``torch.cuda._sleep`` for a duration in microseconds: the kernel spins a number of clock cycles, whose
    rate is measured once, when it is built (a 2 ms spin on a stream of its own, timed with CUDA events: the
    engine is built before training starts, so nobody waits for it)."""

    def __init__(self) -> None:
        if not hasattr(torch.cuda, "_sleep"):
            raise RuntimeError("this PyTorch has no torch.cuda._sleep: the snapshot copy cannot be paced "
                               "(leave --ft-snapshot-copy-piece-mb at 0)")
        probe = 2_000_000
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(probe)  # the first launch loads the kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(probe)
            end.record()
        end.synchronize()
        self.cycles_per_us = probe / max(start.elapsed_time(end) * 1e3, 1e-3)

    def __call__(self, us: float) -> None:
        torch.cuda._sleep(max(1, int(us * self.cycles_per_us)))
