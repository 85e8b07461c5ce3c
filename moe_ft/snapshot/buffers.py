"""Host staging buffers for snapshots (pinned host buffers allocated once and reused).

:class:`HostBuffers` allocates, at build, one contiguous host *arena* per slot, sized for the largest plan
an engine can be asked to run (every operator of the registry at FULL: a COMPUTE entry uses a subset of
the same buffers), and cuts it into one view per ``(operator, tensor)``. Nothing is allocated while
training, so ``submit`` never pays a host allocation or a page-locking call.

Pinning (only when CUDA exists; pinning is meaningless, and unavailable, without a device): the arena is
page-locked with ``cudaHostRegister`` (exact size). ``torch.empty(..., pin_memory=True)`` would round
every allocation up to a power of two (torch's caching host allocator), up to 2x the pinned memory of a
state-sized buffer; it is used only when registering fails. Small metadata tensors whose shapes are only
known at the first snapshot (RNG states, popularity counters) get their own buffers on first use
(:meth:`HostBuffers.get_meta`), reused afterwards.
"""

from __future__ import annotations

from typing import Mapping

import torch

from moe_ft.snapshot import host_register

ALIGN = 64
"""Byte alignment of every view in the arena (cache line; any dtype's element size divides it)."""


class HostBuffers:
    """``num_slots`` independent buffer sets, so the copy of iteration ``t+1`` can proceed while the store
    still writes iteration ``t`` from another slot.

    ``layout``: ``key -> like`` (a tensor whose shape and dtype the buffer takes); every key gets a
    contiguous view in each slot's arena at construction. ``allocated_bytes`` counts the bytes of the views
    and metadata buffers (not the alignment padding); ``arena_bytes`` is the size of one slot's arena."""

    def __init__(self, num_slots: int, pin: bool, layout: Mapping[str, torch.Tensor] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one buffer slot, got {num_slots}")
        self.pin = pin
        self.allocated_bytes = 0
        self._registered: list[torch.Tensor] = []  # arenas page-locked with cudaHostRegister
        self._arenas: list[torch.Tensor] = []
        self._views: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        self._meta: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        offsets, end = {}, 0
        for key, like in (layout or {}).items():
            offsets[key] = end
            end += -(-like.nbytes // ALIGN) * ALIGN
        self.arena_bytes = end
        for slot in range(num_slots):
            arena = self._alloc(end)
            self._arenas.append(arena)
            for key, like in (layout or {}).items():
                start = offsets[key]
                view = arena[start:start + like.nbytes].view(like.dtype).view(like.shape)
                self._views[slot][key] = view
                self.allocated_bytes += view.nbytes

    @property
    def num_slots(self) -> int:
        return len(self._views)

    def view(self, slot: int, key: str) -> torch.Tensor:
        """The buffer of ``key`` in ``slot`` (a key of the build ``layout``)."""
        try:
            return self._views[slot][key]
        except KeyError:
            raise KeyError(f"no host buffer for {key!r}: the engine's buffers were sized from the registry it "
                           "was built with; rebuild the engine after rebuilding the registry") from None

    def get_meta(self, slot: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer of metadata tensor ``key`` in ``slot``, shaped and typed like ``like`` (allocated the
        first time, and again only if the shape or dtype changes)."""
        bufs = self._meta[slot]
        buf = bufs.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            if buf is not None:
                self.allocated_bytes -= buf.nbytes
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            bufs[key] = buf
            self.allocated_bytes += buf.nbytes
        return buf

    def release(self) -> None:
        """Unregister page-locked arenas (the engine calls this when it closes); the buffers stay valid
        as ordinary host memory."""
        while self._registered:
            arena = self._registered.pop()
            torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())

    def _alloc(self, nbytes: int) -> torch.Tensor:
        if not self.pin or nbytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        arena = torch.empty(nbytes, dtype=torch.uint8)
        if not host_register.register(arena.data_ptr(), nbytes):
            self._registered.append(arena)
            return arena
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # registration refused: caching allocator
