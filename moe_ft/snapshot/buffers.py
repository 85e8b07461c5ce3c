"""Host staging buffers for snapshots: allocated once per (slot, operator, tensor), reused every
iteration; pinned only when CUDA exists (pinning is meaningless, and unavailable, without a device)."""

from __future__ import annotations

import torch


class HostBuffers:
    """``num_slots`` independent buffer sets, so the copy of iteration ``t+1`` can proceed while the store
    still writes iteration ``t`` from another slot. A slot's buffers for an operator are allocated the
    first time that operator is copied into it, at its FULL size (COMPUTE uses a subset)."""

    def __init__(self, num_slots: int, pin: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one buffer slot, got {num_slots}")
        self.pin = pin
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(num_slots)]
        self.allocated_bytes = 0

    def get(self, slot: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """The host buffer of ``key`` in ``slot``, shaped and typed like ``like`` (contiguous)."""
        bufs = self._slots[slot]
        buf = bufs.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            bufs[key] = buf
            self.allocated_bytes += buf.nbytes
        return buf
