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

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_ft.state.operators import Level
from moe_ft.store import entry_hash
from moe_ft.store.codec import tensor_specs


def available(store, cuda: bool) -> str:
    """Why the mapped path cannot run for ``store`` (``""``: it can)."""
    if not cuda:
        return "the registry is not on CUDA"
    if not getattr(store.backend, "maps_regions", False):
        return f"the store layout of {store.backend.describe()} cannot map regions (use --ft-store-layout arena)"
    if store.checksum != entry_hash.ALGO:
        return f"the store checksum is {store.checksum}, not {entry_hash.ALGO} (the one a device computes)"
    from moe_ft.store import entry_hash_triton  # start-up time: imports triton (CUDA registries only)

    if not entry_hash_triton.HAVE_TRITON:
        return "triton is not installed"
    return ""


def store_checksum(on_cuda: bool, layout: str, direct_write: bool, bubble_aware: bool) -> str | None:
    """The checksum a snapshot store should use so that the engine copies into it (``mfh64``: for a CUDA
    registry on the arena layout, hashed on the device; for a CPU registry on the arena layout, hashed by the
    copy into the arena when the C build is installed, ``SnapshotStore.copies_hashing``); ``None``: the
    store's default."""
    if not on_cuda:
        return entry_hash.ALGO if layout == "arena" and entry_hash.NATIVE else None
    if not (layout == "arena" and direct_write and not bubble_aware):
        return None
    from moe_ft.store import entry_hash_triton  # start-up time: imports triton (CUDA registries only)

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
        """Register every mapping not registered yet (nothing to do without CUDA)."""
        if not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        for view in self.backend.mapped_segments().values():
            ptr = view.data_ptr()
            if ptr in self._registered:
                continue
            err = cudart.cudaHostRegister(ptr, view.nbytes, 0)
            if err != cudart.cudaError.success:  # the copy still works, at pageable speed and synchronously
                if not self.failed:
                    print(f"moe-ft snapshots: cudaHostRegister of a {view.nbytes} B arena segment of "
                          f"{self.backend.describe()} failed ({err}): copies into it block the host",
                          file=sys.stderr, flush=True)
                self.failed = f"cudaHostRegister of {view.nbytes} B failed ({err})"
            else:
                self._registered[ptr] = view

    def release(self) -> None:
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        while self._registered:
            ptr, _ = self._registered.popitem()
            cudart.cudaHostUnregister(ptr)


@dataclass
class _Prep:
    """What the copier keeps per engine entry (its tensors are fixed): the tensors' specs (the store's
    layout cache key) and flat byte views of the sources (one split of the region gives the destinations)."""

    entry: Any  # the engine's _Entry (kept: its id keys the plans)
    like: dict
    specs: tuple
    byte_srcs: list | None  # None: a source is not contiguous, copy through typed views
    on_device: list  # per source: whether the device copies (and hashes) it
    all_on_device: bool


@dataclass
class _Plan:
    """How a composition of entries (a sparse plan repeats every window) is hashed: one table for the
    device tensors it can take, the rest one by one, the host-resident ones at seal time."""

    table: Any  # TensorTable | None
    slots: list  # per entry: [(kind, index)] per tensor: ("table", row) | ("single", i) | ("host", -1)
    singles: list  # [(device tensor, first word)]

    @property
    def rows(self) -> int:
        """Rows of sums it copies to the host: the table's, then the singles'."""
        return (len(self.table.tensors) if self.table is not None else 0) + len(self.singles)


@dataclass
class MappedJob:
    """What :meth:`MappedCopier.issue` queued for one snapshot: the point, its reserved entries, the remote
    entries and where the tensors' sums land."""

    point: Any  # PendingPoint
    reserved: list  # [(ReservedEntry, _Prep)]
    remote: list = field(default_factory=list)  # [(EntryLayout, _Prep)]
    plan: _Plan | None = None
    rows: torch.Tensor | None = None  # pinned host rows the plan's sums are copied into
    host_bytes: int = 0


class MappedCopier:
    """Issues a snapshot's copies into mapped store regions and seals them (module docstring)."""

    def __init__(self, store, stream, *, capacity: int = 64, on_device=None, pacer=None) -> None:
        """``capacity``: rows of sums a job may need (two per tensor of the registry covers any plan, remote
        entries included); ``on_device(tensor)``: whether a source is hashed by the kernel (default: it is on
        CUDA; the CPU tests hash CPU tensors with the kernel under ``TRITON_INTERPRET=1``); ``pacer``: a
        :class:`moe_ft.snapshot.pacing.CopyPacer` that issues the device-to-host copy in pieces (``None``:
        all of it at once)."""
        self.store, self.stream = store, stream
        self.capacity = capacity
        self.on_device = on_device or (lambda t: t.is_cuda)
        self.pacer = pacer
        self.pinned = PinnedSegments(store.backend)
        self.pinned.refresh()
        self._preps: dict[int, _Prep] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._rows: dict[int, torch.Tensor] = {}  # slot -> pinned rows for its job's sums

    def _prep(self, entry) -> _Prep:
        prep = self._preps.get(id(entry))
        if prep is None:
            like = dict(zip(entry.out, entry.srcs))
            flat = all(s.is_contiguous() for s in entry.srcs)
            prep = self._preps[id(entry)] = _Prep(
                entry=entry, like=like, specs=tensor_specs(like),
                byte_srcs=[s.reshape(-1).view(torch.uint8) for s in entry.srcs] if flat else None,
                on_device=(dev := [bool(self.on_device(s)) for s in entry.srcs]), all_on_device=all(dev))
        return prep

    def issue(self, iteration: int, slot: int, items, remote_ops) -> MappedJob:
        """Training thread, inside ``torch.cuda.stream(self.stream)`` after it waited for the compute
        stream: reserve the regions of ``items`` (the engine's entries; ``remote_ops``: FULL entries only
        hashed), queue the device-to-host copies and the device hashes. Host-resident tensors are copied
        at once. Raises ``OSError`` when the store has no room (nothing is left reserved)."""
        point = self.store.begin(iteration)
        job = MappedJob(point=point, reserved=[])
        try:
            for entry in items:
                prep = self._prep(entry)
                if entry.level == Level.FULL and entry.op in remote_ops:
                    job.remote.append((point.layout(entry.op, Level.FULL, prep.specs), prep))
                else:
                    job.reserved.append((point.reserve(entry.op, entry.level, prep.like, prep.specs), prep))
        except BaseException:
            point.abort()
            raise
        self.pinned.refresh()  # a segment the arena just added
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        typed_dst: list[torch.Tensor] = []
        typed_src: list[torch.Tensor] = []
        host_dst: list[torch.Tensor] = []
        host_src: list[torch.Tensor] = []
        for reserved, prep in job.reserved:
            if prep.byte_srcs is not None:  # flat bytes: the pacer may cut them
                dsts, srcs, to_dst, to_src = reserved.byte_views(), prep.byte_srcs, dst, src
            else:
                dsts, srcs, to_dst, to_src = list(reserved.views.values()), prep.entry.srcs, typed_dst, typed_src
            if prep.all_on_device:
                to_dst.extend(dsts)
                to_src.extend(srcs)
                continue
            for d, s, dev in zip(dsts, srcs, prep.on_device):
                if dev:
                    to_dst.append(d)
                    to_src.append(s)
                else:
                    host_dst.append(d)
                    host_src.append(s)
                    job.host_bytes += s.nbytes
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)
        if typed_dst:
            torch._foreach_copy_(typed_dst, typed_src, non_blocking=True)
        if dst and self.pacer is not None:
            self.pacer.copy(dst, src)
        elif dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
        job.plan = self._plan(job)
        job.rows = self._slot_rows(slot, job.plan.rows)
        self._hash(job.plan, job.rows)
        return job

    def _slot_rows(self, slot: int, n: int) -> torch.Tensor:
        """``n`` pinned rows of ``slot`` (a slot's job is sealed before the slot is used again; a plan's
        device buffers are reused by the next launch on the same stream, after this copy)."""
        rows = self._rows.get(slot)
        if rows is None or rows.shape[0] < n:
            rows = self._rows[slot] = torch.empty((max(n, self.capacity), 2), dtype=torch.int64,
                                                  pin_memory=torch.cuda.is_available())
        return rows[:n]

    @staticmethod
    def _entries_of(job: MappedJob):
        """(sources, layout) of every entry whose digest is needed, in a fixed order."""
        return [(p.entry.srcs, r.layout) for r, p in job.reserved] + [(p.entry.srcs, lay) for lay, p in job.remote]

    def _plan(self, job: MappedJob) -> _Plan:
        from moe_ft.store.entry_hash_triton import TensorTable, tableable  # start-up time: triton, CUDA only

        entries = self._entries_of(job)
        # the engine's entries are fixed (their ids name the sources) and cached layouts are immutable: a
        # sparse window's plans are built in its first window, then reused
        key = (*((id(p.entry), id(r.layout)) for r, p in job.reserved),
               None, *((id(p.entry), id(lay)) for lay, p in job.remote))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        rows: list[torch.Tensor] = []
        firsts_t: list[int] = []
        singles: list[tuple[torch.Tensor, int]] = []
        slots: list[list[tuple[str, int]]] = []
        for srcs, layout in entries:
            kinds: list[tuple[str, int]] = []
            for s, first in zip(srcs, layout.first_words):
                if not self.on_device(s):
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
        plan = self._plans[key] = _Plan(table=table, slots=slots, singles=singles)
        return plan

    @staticmethod
    def _hash(plan: _Plan, out: torch.Tensor) -> None:
        """Queue the lane sums of every device tensor and their copy into ``out`` (pinned rows) on the
        current stream: the snapshot stream, ordered after the optimizer step that made the tensors."""
        from moe_ft.store.entry_hash_triton import device_lane_sums  # start-up time: triton, CUDA only

        parts = [plan.table.launch()] if plan.table is not None else []
        parts += [device_lane_sums(s, first).reshape(1, 2) for s, first in plan.singles]
        if parts:
            out.copy_(torch.cat(parts) if len(parts) > 1 else parts[0], non_blocking=True)

    def seal(self, job: MappedJob) -> None:
        """Background thread, after the copy event completed: seal every entry with its tensors' sums."""
        plan = job.plan
        assert plan is not None and job.rows is not None
        rows = job.rows.tolist()
        n_table = len(plan.table.tensors) if plan.table is not None else 0
        sums_per_entry = []
        for (srcs, layout), kinds in zip(self._entries_of(job), plan.slots):
            sums = []
            for s, first, (kind, i) in zip(srcs, layout.first_words, kinds):
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
        for (layout, prep), sums in zip(job.remote, sums_per_entry[len(job.reserved):]):
            job.point.put_remote(prep.entry.op, prep.like, tensor_sums=sums, layout=layout)

    def close(self) -> None:
        self.pinned.release()
