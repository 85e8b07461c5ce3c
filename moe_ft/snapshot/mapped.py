"""GPU snapshots that land in the store: one device-to-host copy straight into the entry's arena region,
its checksum computed on the device, and nothing left for the trainer's host threads but the headers.

Why (MoEvement §3.2 overlaps the snapshot copy with the next iteration; MoC §5.2 makes it asynchronous):
once the copy runs at the link's bandwidth, what slows training is every host pass the trainer still makes
over the bytes afterwards -- a checksum and a store write per byte, on threads that share the host with the
training loop. Here there are none:

* **Regions, not buffers.** The arena store (``moe_ft/store/arena.py``) maps its segment files once per
  process; this module page-locks each mapping with ``cudaHostRegister`` when the engine is built (a new
  segment when it first appears), so a region of a point *is* pinned host memory. ``submit`` reserves each
  entry's region (:meth:`moe_ft.store.store.PendingPoint.reserve`: the entry laid out, its tensors' places
  known) and queues the copies into those places on the snapshot stream.
* **Checksums where the bytes are.** The entry digest is ``mfh64`` (``moe_ft/store/entry_hash.py``): a sum
  of per-word terms keyed by the word's place in the entry, so each tensor's share can be computed from the
  device tensor, in one Triton launch for all tensors of the snapshot
  (:class:`moe_ft.store.entry_hash_triton.TensorTable`), on the same stream right after the copies and
  before the compute stream may change them again. The host adds the header's share when it seals the
  entry. A reader verifies the whole entry on the host as for any other checksum, so a copy that went
  wrong on the way is caught at recovery.
* **Publishing is metadata.** The engine's background thread waits for the copy event, seals each entry
  (header, padding, digest: a few hundred bytes), writes the metadata entry and links the point's index.

The trainer process touches no payload byte on the host (``SnapshotRecord.host_bytes_touched`` counts only
host-resident tensors, e.g. a CPU step counter). Tensors the table cannot take (not 4-byte aligned or not
whole words: small integer tensors) are hashed on the device one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe_ft.state.operators import Level
from moe_ft.store import entry_hash


def available(store, cuda: bool) -> str:
    """Why the mapped path cannot run for ``store`` (``""``: it can)."""
    if not cuda:
        return "the registry is not on CUDA"
    if not getattr(store.backend, "maps_regions", False):
        return f"the store layout of {store.backend.describe()} cannot map regions (use --ft-store-layout arena)"
    if store.checksum != entry_hash.ALGO:
        return f"the store checksum is {store.checksum}, not {entry_hash.ALGO} (the one a device computes)"
    from moe_ft.store import entry_hash_triton

    if not entry_hash_triton.HAVE_TRITON:
        return "triton is not installed"
    return ""


def store_checksum(on_cuda: bool, layout: str, direct_write: bool, bubble_aware: bool) -> str | None:
    """The checksum a snapshot store should use so that the engine copies into it (``mfh64`` for a CUDA
    registry on the arena layout); ``None``: the store's default."""
    if not (on_cuda and layout == "arena" and direct_write and not bubble_aware):
        return None
    from moe_ft.store import entry_hash_triton

    return entry_hash.ALGO if entry_hash_triton.HAVE_TRITON else None


class PinnedSegments:
    """The arena's mappings, page-locked once each (``cudaHostRegister``): a copy into a region is a DMA
    into pinned memory. Registration is slow (seconds for GBs), so it happens when the engine is built
    and, for a segment the arena adds later, at the first copy that needs it."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> the mapping (kept alive)
        self.failed = ""

    def refresh(self) -> None:
        """Register every mapping not registered yet."""
        cudart = torch.cuda.cudart()
        for view in self.backend.mapped_segments().values():
            ptr = view.data_ptr()
            if ptr in self._registered:
                continue
            err = cudart.cudaHostRegister(ptr, view.nbytes, 0)
            if err != cudart.cudaError.success:  # the copy still works, at pageable speed and synchronously
                self.failed = f"cudaHostRegister of {view.nbytes} B failed ({err})"
            else:
                self._registered[ptr] = view

    def release(self) -> None:
        cudart = torch.cuda.cudart()
        while self._registered:
            ptr, _ = self._registered.popitem()
            cudart.cudaHostUnregister(ptr)


@dataclass
class _Plan:
    """How a composition of entries (a sparse plan repeats every window) is hashed: one table for the
    device tensors it can take, the rest one by one, the host-resident ones at seal time."""

    table: object  # TensorTable | None
    slots: list  # per entry: [(kind, index)] per tensor: ("table", row) | ("single", i) | ("host", -1)
    singles: list  # [(device tensor, first word)]
    pinned: torch.Tensor  # host copy of the table's sums and the singles' sums, rows in that order


@dataclass
class MappedJob:
    """What :func:`issue` queued for one snapshot: the point, its reserved entries, the remote entries and
    where the tensors' sums land."""

    point: Any  # PendingPoint
    reserved: list  # [(ReservedEntry, [src tensors])]
    remote: list = field(default_factory=list)  # [(op, like tensors, layout first words)]
    plan: _Plan | None = None
    host_bytes: int = 0


class MappedCopier:
    """Issues a snapshot's copies into mapped store regions and seals them (module docstring)."""

    def __init__(self, store, stream) -> None:
        self.store, self.stream = store, stream
        self.pinned = PinnedSegments(store.backend)
        self.pinned.refresh()
        self._plans: dict[tuple, _Plan] = {}

    def issue(self, iteration: int, slot: int, items, remote_ops) -> MappedJob:
        """Training thread, inside ``torch.cuda.stream(self.stream)`` after it waited for the compute
        stream: reserve the regions of ``items`` (the engine's entries; ``remote_ops``: FULL entries only
        hashed), queue the device-to-host copies and the device hashes. Host-resident tensors are copied
        at once. Raises ``OSError`` when the store has no room (nothing is left reserved)."""
        point = self.store.begin(iteration)
        job = MappedJob(point=point, reserved=[])
        try:
            for entry in items:
                like = dict(zip(entry.out, entry.srcs))
                if entry.level == Level.FULL and entry.op in remote_ops:
                    layout, head = point.remote_layout(entry.op, like)
                    job.remote.append((entry.op, like, layout, head))
                else:
                    job.reserved.append((point.reserve(entry.op, entry.level, like), entry.srcs))
        except BaseException:
            point.abort()
            raise
        self.pinned.refresh()  # a segment the arena just added
        dst, src, host_dst, host_src = [], [], [], []
        for reserved, srcs in job.reserved:
            for view, s in zip(reserved.views.values(), srcs):
                if s.is_cuda:
                    dst.append(view)
                    src.append(s)
                else:
                    host_dst.append(view)
                    host_src.append(s)
                    job.host_bytes += s.nbytes
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)
        if dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
        job.plan = self._plan(job, slot)
        self._hash(job.plan)
        return job

    def _entries_of(self, job: MappedJob):
        """(srcs, first words) of every entry whose digest is needed, in a fixed order."""
        out = [(srcs, r.first_words) for r, srcs in job.reserved]
        out += [(list(like.values()), [rec["offset"] // 4 for rec in layout.table]) for _, like, layout, _ in job.remote]
        return out

    def _plan(self, job: MappedJob, slot: int) -> _Plan:
        from moe_ft.store.entry_hash_triton import TensorTable, tableable

        entries = self._entries_of(job)
        # per slot: a plan's pinned rows and table outputs are reused only once its slot's job is done
        key = (slot, *((tuple(s.data_ptr() for s in srcs), tuple(firsts)) for srcs, firsts in entries))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        rows: list[torch.Tensor] = []
        firsts_t: list[int] = []
        singles: list[tuple[torch.Tensor, int]] = []
        slots: list[list[tuple[str, int]]] = []
        for srcs, firsts in entries:
            kinds: list[tuple[str, int]] = []
            for s, first in zip(srcs, firsts):
                if not s.is_cuda:
                    kinds.append(("host", -1))
                elif tableable(s):
                    kinds.append(("table", len(rows)))
                    rows.append(s)
                    firsts_t.append(first)
                else:
                    kinds.append(("single", len(singles)))
                    singles.append((s, first))
            slots.append(kinds)
        table = TensorTable(rows, firsts_t) if rows else None
        pinned = torch.empty((len(rows) + len(singles), 2), dtype=torch.int64, pin_memory=True)
        plan = self._plans[key] = _Plan(table=table, slots=slots, singles=singles, pinned=pinned)
        return plan

    @staticmethod
    def _hash(plan: _Plan) -> None:
        """Queue the lane sums of every device tensor and their copy into the plan's pinned rows (on the
        current stream: the snapshot stream, ordered after the optimizer step that made the tensors)."""
        from moe_ft.store.entry_hash_triton import device_lane_sums

        parts = [plan.table.launch()] if plan.table is not None else []  # type: ignore[attr-defined]
        parts += [device_lane_sums(s, first).reshape(1, 2) for s, first in plan.singles]
        if parts:
            plan.pinned.copy_(torch.cat(parts) if len(parts) > 1 else parts[0], non_blocking=True)

    def seal(self, job: MappedJob) -> None:
        """Background thread, after the copy event completed: seal every entry with its tensors' sums."""
        plan = job.plan
        assert plan is not None
        rows = plan.pinned.tolist()
        n_table = len(plan.table.tensors) if plan.table is not None else 0  # type: ignore[attr-defined]
        entries = self._entries_of(job)
        sums_per_entry = []
        for (srcs, firsts), kinds in zip(entries, plan.slots):
            sums = []
            for s, first, (kind, i) in zip(srcs, firsts, kinds):
                if kind == "table":
                    sums.append(rows[i])
                elif kind == "single":
                    sums.append(rows[n_table + i])
                else:
                    sums.append(entry_hash.lane_sums_of(s, first))
                    job.host_bytes += s.nbytes
            sums_per_entry.append(sums)
        for (reserved, _), sums in zip(job.reserved, sums_per_entry):
            reserved.seal(sums)
        for (op, like, layout, head), sums in zip(job.remote, sums_per_entry[len(job.reserved):]):
            job.point.put_remote(op, like, tensor_sums=sums, layout=(layout, head))

    def close(self) -> None:
        self.pinned.release()
