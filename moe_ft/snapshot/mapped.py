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
* **Or the kernel copies** (``copy_by="kernel"``, ``--ft-snapshot-copy-by kernel``): the same launch stores
  every word it hashes at the tensor's place in its region, through the device's mapping of the page-locked
  segment (:meth:`PinnedSegments.device_address`), on a few programs that leave the other SMs to training.
  Nothing then waits in the copy engine's queue, where the training thread's own reads from the device
  (the MoE dispatcher's token counts) would queue behind the snapshot (``moe_ft/snapshot/pacing.py`` says
  why that costs).
* **Publishing is metadata.** The engine's background thread waits for the copy event, seals each entry
  (header, padding, digest: a few hundred bytes), writes the metadata entry and links the point's index.

The trainer process touches no payload byte on the host (``SnapshotRecord.host_bytes_touched`` counts only
host-resident tensors, e.g. a CPU step counter: copied at issue, on the training thread, and hashed from that
copy when the entry is sealed, since the training thread may change the tensor in between). Tensors the table cannot take (not 4-byte aligned or not
whole words: small integer tensors) are hashed on the device one by one.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moe_ft.snapshot import host_register
from moe_ft.state.operators import Level
from moe_ft.store import entry_hash
from moe_ft.store.codec import tensor_specs

COPY_BY = ("dma", "kernel")
"""How the snapshot's bytes reach their regions (:class:`MappedCopier`)."""


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

    def __init__(self, backend, device_addresses: bool = False) -> None:
        """``device_addresses``: also ask each registered segment's device address as it is registered (for a
        kernel that writes into the segments); :attr:`unreachable` says why one could not be had."""
        self.backend = backend
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> the mapping (kept alive)
        self._device_bases: dict[int, int] = {}  # data_ptr -> the device's address of it
        self._want_device_addresses = device_addresses
        self._cuda = torch.cuda.is_available()  # asked once: device_address runs per entry on the training thread
        self._last_base = 0  # the segment the last address was found in (a point's regions share a few)
        self.failed = ""
        self.unreachable = ""

    def refresh(self) -> None:
        """Register every mapping not registered yet (nothing to do without CUDA)."""
        if not torch.cuda.is_available():
            return
        for view in self.backend.mapped_segments().values():
            ptr = view.data_ptr()
            if ptr in self._registered:
                continue
            why = host_register.register(ptr, view.nbytes)
            if why:  # the copy still works, at pageable speed and synchronously
                if not self.failed:
                    print(f"moe-ft snapshots: page-locking an arena segment of {self.backend.describe()}: {why}; "
                          f"copies into it block the host (is --ft-store-dir on a tmpfs such as /dev/shm?)",
                          file=sys.stderr, flush=True)
                self.failed = why
            else:
                self._registered[ptr] = view
                if self._want_device_addresses and not self.unreachable:
                    try:
                        self._device_bases[ptr] = _mapped_device_pointer(ptr)
                    except RuntimeError as e:
                        self.unreachable = str(e)

    def device_address(self, host_ptr: int) -> int:
        """The address at which a kernel reaches the registered host byte ``host_ptr`` (page-locked memory is
        mapped for the device; its device address need not be the host's, ``cuMemHostGetDevicePointer``, asked
        at registration when ``device_addresses``). Without CUDA (the kernel interpreted on CPU tensors):
        ``host_ptr``."""
        if not self._cuda:
            return host_ptr
        for base in (self._last_base, *self._registered):
            view = self._registered.get(base)
            if view is not None and base <= host_ptr < base + view.nbytes and base in self._device_bases:
                self._last_base = base
                return self._device_bases[base] + (host_ptr - base)
        raise RuntimeError(f"moe-ft snapshots: host address {host_ptr:#x} is in no page-locked arena segment of "
                           f"{self.backend.describe()} whose device address is known (device_addresses=True)")

    def release(self) -> None:
        self._device_bases.clear()
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        while self._registered:
            ptr, _ = self._registered.popitem()
            cudart.cudaHostUnregister(ptr)


def _mapped_device_pointer(host_ptr: int) -> int:
    """The device address of registered host memory at ``host_ptr``, through the CUDA driver
    (``cuMemHostGetDevicePointer``; torch exposes no runtime call for it). Needs the current thread's CUDA
    context, which torch has made current on the thread that uses the device."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"moe-ft snapshots: the CUDA driver's cuMemHostGetDevicePointer is not reachable "
                           f"({e}); copy with --ft-snapshot-copy-by dma") from e
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out = ctypes.c_uint64()
    rc = fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != 0:
        raise RuntimeError(f"moe-ft snapshots: cuMemHostGetDevicePointer({host_ptr:#x}) failed (CUresult {rc}); "
                           "copy with --ft-snapshot-copy-by dma")
    return int(out.value)


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
    row_entry: Any = None  # np.ndarray: per table row, its reserved entry's index (-1: a remote entry's)
    row_offset: Any = None  # np.ndarray: per table row, the tensor's byte offset in its entry (0: remote)
    dst: torch.Tensor | None = None  # per table row, where the kernel copies it (on the table's device)

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
    host_copies: dict = field(default_factory=dict)
    """(entry index, tensor index) -> a host-resident tensor's bytes as copied into its region at issue: what
    :meth:`MappedCopier.seal` hashes. The live tensor may have changed by then (a CPU step counter that the
    next optimizer step increments), and its entry would fail its checksum."""
    host_sums: dict = field(default_factory=dict)
    """(entry index, tensor index) -> the lane sums of a remote entry's host-resident tensor, taken at issue
    (nothing of it is copied to hash later)."""


class MappedCopier:
    """Issues a snapshot's copies into mapped store regions and seals them (module docstring)."""

    def __init__(self, store, stream, *, capacity: int = 64, on_device=None, pacer=None, copy_by: str = "dma",
                 programs: int = 0) -> None:
        """``capacity``: rows of sums a job may need (two per tensor of the registry covers any plan, remote
        entries included); ``on_device(tensor)``: whether a source is hashed by the kernel (default: it is on
        CUDA; the CPU tests hash CPU tensors with the kernel under ``TRITON_INTERPRET=1``); ``pacer``: a
        :class:`moe_ft.snapshot.pacing.CopyPacer` that issues the device-to-host copy in pieces (``None``:
        all of it at once). ``copy_by``: ``"dma"`` (the copy engine copies, the kernel then hashes) or
        ``"kernel"`` (the hash kernel also stores each word it hashed into the region, through the device's
        mapping of the page-locked arena: no transfer in the copy engine's queue, one launch for the copy and
        the hash; tensors the table cannot take still go by DMA); ``programs``: at most this many programs in
        that kernel's grid (0: one per block of words)."""
        if copy_by not in COPY_BY:
            raise ValueError(f"copy_by must be one of {COPY_BY}, got {copy_by!r}")
        if programs < 0:
            raise ValueError(f"programs must be >= 0, got {programs}")
        self.store, self.stream = store, stream
        self.capacity = capacity
        self.on_device = on_device or (lambda t: t.is_cuda)
        self.pacer = pacer
        self.copy_by, self.programs = copy_by, programs
        self.pinned = PinnedSegments(store.backend, device_addresses=copy_by == "kernel")
        self.pinned.refresh()
        self._preps: dict[int, _Prep] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._rows: dict[int, torch.Tensor] = {}  # slot -> pinned rows for its job's sums
        self._stage: dict[int, torch.Tensor] = {}  # slot -> pinned addresses for its job's kernel copy

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
            local: list[_Prep] = []
            for entry in items:
                prep = self._prep(entry)
                if entry.level == Level.FULL and entry.op in remote_ops:
                    job.remote.append((point.layout(entry.op, Level.FULL, prep.specs), prep))
                else:
                    local.append(prep)
            reserved = point.reserve_all([(p.entry.op, p.entry.level, None, p.specs) for p in local])
            job.reserved = list(zip(reserved, local))
        except BaseException:
            point.abort()
            raise
        self.pinned.refresh()  # a segment the arena just added
        if self.copy_by == "kernel" and (self.pinned.failed or self.pinned.unreachable):
            print(f"moe-ft snapshots: the copy engine copies from now on (--ft-snapshot-copy-by kernel needs every "
                  f"arena segment page-locked and mapped for the device: "
                  f"{self.pinned.failed or self.pinned.unreachable})", file=sys.stderr, flush=True)
            self.copy_by = "dma"
        job.plan = plan = self._plan(job)
        by_kernel = self.copy_by == "kernel"
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        typed_dst: list[torch.Tensor] = []
        typed_src: list[torch.Tensor] = []
        host_dst: list[torch.Tensor] = []
        host_src: list[torch.Tensor] = []
        for e, ((reserved, prep), kinds) in enumerate(zip(job.reserved, plan.slots)):
            if by_kernel and all(kind == "table" for kind, _ in kinds):
                continue  # the kernel copies every tensor of the entry
            if prep.byte_srcs is not None:  # flat bytes: the pacer may cut them
                dsts, srcs, to_dst, to_src = reserved.byte_views(), prep.byte_srcs, dst, src
            else:
                dsts, srcs, to_dst, to_src = list(reserved.views.values()), prep.entry.srcs, typed_dst, typed_src
            if prep.all_on_device and not by_kernel:
                to_dst.extend(dsts)
                to_src.extend(srcs)
                continue
            for i, (d, s, dev, (kind, _)) in enumerate(zip(dsts, srcs, prep.on_device, kinds)):
                if by_kernel and kind == "table":
                    continue
                if dev:
                    to_dst.append(d)
                    to_src.append(s)
                else:
                    host_dst.append(d)
                    host_src.append(s)
                    job.host_copies[e, i] = d
                    job.host_bytes += s.nbytes
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)
        first_remote = len(job.reserved)
        for r, ((layout, prep), kinds) in enumerate(zip(job.remote, plan.slots[first_remote:])):
            for i, (s, first, (kind, _)) in enumerate(zip(prep.entry.srcs, layout.first_words, kinds)):
                if kind == "host":  # hashed now, as it is now: the digest is of the state this snapshot takes
                    job.host_sums[first_remote + r, i] = entry_hash.lane_sums_of(s, first)
                    job.host_bytes += s.nbytes
        if typed_dst:
            torch._foreach_copy_(typed_dst, typed_src, non_blocking=True)
        if dst and self.pacer is not None:
            self.pacer.copy(dst, src)
        elif dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
        job.rows = self._slot_rows(slot, plan.rows)
        self._hash(plan, job.rows, self._destinations(job, slot) if by_kernel else None, self.programs)
        return job

    def _destinations(self, job: MappedJob, slot: int) -> torch.Tensor | None:
        """Where the kernel copies each table row of ``job``'s plan: the device's addresses of the tensors'
        places in their reserved regions (0 for a remote entry's rows, which are only hashed), staged in
        ``slot``'s pinned buffer and queued to the device on the current stream."""
        plan = job.plan
        assert plan is not None
        if plan.table is None:
            return None
        bases = np.fromiter((self.pinned.device_address(r.address) for r, _ in job.reserved), dtype=np.int64,
                            count=len(job.reserved))
        addrs = np.append(bases, 0)[plan.row_entry] + plan.row_offset  # row_entry -1: the 0 appended
        stage = self._stage.get(slot)
        if stage is None or stage.numel() < addrs.size:
            stage = self._stage[slot] = torch.empty(max(addrs.size, self.capacity), dtype=torch.int64,
                                                    pin_memory=torch.cuda.is_available())
        stage[:addrs.size].numpy()[:] = addrs  # the slot's last job was sealed: its copy read the stage long ago
        assert plan.dst is not None
        plan.dst.copy_(stage[:addrs.size], non_blocking=True)
        return plan.dst

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
        row_entry: list[int] = []
        row_offset: list[int] = []
        singles: list[tuple[torch.Tensor, int]] = []
        slots: list[list[tuple[str, int]]] = []
        for j, (srcs, layout) in enumerate(entries):
            kinds: list[tuple[str, int]] = []
            local = j < len(job.reserved)
            for s, first, rec in zip(srcs, layout.first_words, layout.table):
                if not self.on_device(s):
                    kinds.append(("host", -1))
                elif tableable(s):
                    kinds.append(("table", len(rows)))
                    rows.append(s)
                    firsts_t.append(first)
                    row_entry.append(j if local else -1)
                    row_offset.append(rec["offset"] if local else 0)
                else:
                    kinds.append(("single", len(singles)))
                    singles.append((s, first))
            slots.append(kinds)
        table = TensorTable(rows, firsts_t) if rows else None
        plan = self._plans[key] = _Plan(
            table=table, slots=slots, singles=singles, row_entry=np.array(row_entry, dtype=np.int64),
            row_offset=np.array(row_offset, dtype=np.int64),
            dst=torch.empty(len(rows), dtype=torch.int64, device=rows[0].device) if rows else None)
        return plan

    @staticmethod
    def _hash(plan: _Plan, out: torch.Tensor, dst: torch.Tensor | None = None, programs: int = 0) -> None:
        """Queue the lane sums of every device tensor and their copy into ``out`` (pinned rows) on the
        current stream: the snapshot stream, ordered after the optimizer step that made the tensors.
        ``dst``: the table's kernel also copies its rows there (:meth:`_destinations`)."""
        from moe_ft.store.entry_hash_triton import device_lane_sums  # start-up time: triton, CUDA only

        parts = [plan.table.launch(dst, programs)] if plan.table is not None else []
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
        for e, ((_, layout), kinds) in enumerate(zip(self._entries_of(job), plan.slots)):
            sums = []
            for t, (first, (kind, i)) in enumerate(zip(layout.first_words, kinds)):
                if kind == "table":
                    sums.append(rows[i])
                elif kind == "single":
                    sums.append(rows[n_table + i])
                elif (e, t) in job.host_sums:
                    sums.append(job.host_sums[e, t])
                else:  # the bytes copied at issue, not the live tensor (MappedJob.host_copies)
                    copied = job.host_copies[e, t]
                    sums.append(entry_hash.lane_sums_of(copied, first))
                    job.host_bytes += copied.nbytes
            sums_per_entry.append(sums)
        for (reserved, _), sums in zip(job.reserved, sums_per_entry):
            reserved.finish(sums)
        for (layout, prep), sums in zip(job.remote, sums_per_entry[len(job.reserved):]):
            job.point.put_remote(prep.entry.op, prep.like, tensor_sums=sums, layout=layout)

    def close(self) -> None:
        self.pinned.release()
