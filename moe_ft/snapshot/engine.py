"""Snapshot engine (MoEvement §3.2 "snapshots overlap the next iteration's forward/backward";
MoC §5.2 asynchronous snapshotting): executes a plan, never decides one.

Timeline of iteration ``t`` (the state after the update of ``t`` is what the snapshot of ``t`` holds)::

    optimizer.step(t) → submit(t, plan)  ──copy→ host buffers──►  ──write→ store, publish──►
                        forward/backward(t+1) runs meanwhile
                        wait_copied() ← right before optimizer.step(t+1); the wait is the *stall*

* **CPU** (the registry's tensors live on the CPU): a background thread writes the plan's live tensors
  straight into the store's entry files (checksum + ``write``: one copy; ``EngineConfig.direct_write``),
  then the metadata entry and the manifest. Forward/backward only read the weights, so the writes overlap
  them; ``wait_copied`` blocks the training thread until the operators' entries are written (not until
  the point is published). With a bubble schedule (or ``direct_write=False``) the thread first copies the
  tensors into host buffers (a slot) and ``wait_copied`` waits for that copy only.
* **GPU** (any registry tensor on CUDA): ``submit`` makes a side CUDA stream wait for the compute stream
  (the optimizer step of ``t`` is queued there), issues the device-to-host copies on it, non-blocking, and
  records an event. By default (``mapped``, :class:`moe_ft.snapshot.mapped.MappedCopier`) they land in the
  regions the store reserved in its page-locked arena and a kernel hashes them on the device; otherwise
  (``mapped_off`` says why: ``direct_write=False``, a bubble schedule, a store that cannot map) into a
  slot's page-locked buffers in one batched call (``torch._foreach_copy_``), which the thread then writes.
  ``wait_copied`` never blocks the host: it makes the *compute stream* wait for that event
  (``current_stream().wait_event``), so the optimizer step of ``t+1`` is queued behind the copy on the
  device only. The background thread waits for the event (asleep: a blocking event, not a spin) and then
  writes. Host-resident tensors of a CUDA registry (e.g. a CPU ``step`` counter) are copied on the host
  inside ``submit``.

Stall accounting (``SnapshotRecord``): ``stall_s`` is host time the training thread lost in ``submit``
(waiting for a free slot) and ``wait_copied`` (on GPU: the ``wait_event`` call, ~microseconds);
``device_stall_s`` (GPU only) is how long the compute stream waited for the copy, from timing events:
``max(0, copy_done - compute_reached_wait)``. ``copy_s`` is the device time of the copy on GPU (from events)
and the thread's copy time on CPU.

Buffers: ``num_slots`` host buffer sets allocated once, at build (:class:`HostBuffers`: for every operator at
FULL where the copies go through slots, else for the metadata only) and reused; ``submit`` waits for a free slot when the store is slower than training
(that wait is counted as stall as well, and separately as ``slot_wait_s``). The background thread writes
a snapshot's entries through ``EngineConfig.write_threads`` threads (the store's per-entry checksum and
write are the narrow part of the pipeline on GPU, not the copy).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Mapping

import torch

from moe_ft.background import BackgroundWorker
from moe_ft.snapshot.bubbles import BubbleSchedule  # noqa: F401  (EngineConfig.bubbles)
from moe_ft.snapshot.buffers import HostBuffers
from moe_ft.snapshot.mapped import COPY_BY, MappedCopier, available
from moe_ft.snapshot.pacing import CopyPacer
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.codec import tensor_specs
from moe_ft.store.errors import store_full


@dataclass(kw_only=True)
class EngineConfig:
    """Snapshot engine knobs."""

    num_slots: int = 2
    """Host buffer sets; 2 lets the copy of ``t+1`` start while ``t`` is still being written."""
    pin_memory: bool | None = None
    """Page-lock the host buffers; ``None``: iff the registry is on CUDA (pinning needs a device)."""
    bubbles: "BubbleSchedule | None" = None
    """Bubble-aware scheduling (MoEtion Alg. 4, ``moe_ft/snapshot/bubbles.py``; CPU path): part of each copy
    waits for the pipeline bubbles its gate reports. ``None``: the whole copy starts at once."""
    write_threads: int | None = None
    """Threads writing one snapshot's entries to the store in parallel (checksum + write release the GIL;
    one thread sustains ~1.3 GB/s on an H100 host, far below the ~55 GB/s of the copy). ``None``: 1 on CPU
    (the training processes own the cores), 4 on GPU."""

    direct_write: bool | None = None
    """One copy instead of two (CPU path): the background thread checksums and writes the live tensors
    straight into the store's entry files, and ``wait_copied`` returns once they are written; no slot
    buffers are allocated for operators. ``None``: on for a CPU registry without a bubble schedule (whose
    tensors are all contiguous), off otherwise. On the GPU path ``False`` turns off the copies into the store's
    regions (``mapped``): the copies go into pinned slot buffers first."""

    copy_piece_bytes: int = 0
    """GPU path into the store's regions: queue the device-to-host copy in pieces of at most this many bytes,
    each after the previous one ended (``moe_ft/snapshot/pacing.py``: the training thread's own small reads
    from the device then wait for one piece, not the whole snapshot). 0: the whole copy queued at once."""

    copy_by: str = "dma"
    """GPU path into the store's regions: ``"dma"`` (the copy engine copies, a kernel hashes) or ``"kernel"``
    (the hash kernel also stores the words into the regions through the device's mapping of the page-locked
    arena: :class:`moe_ft.snapshot.mapped.MappedCopier`)."""
    copy_programs: int = 16
    """With ``copy_by="kernel"``: the copy kernel's programs (0: one per block of words)."""

    def __post_init__(self) -> None:
        if self.copy_by not in COPY_BY:
            raise ValueError(f"EngineConfig.copy_by must be one of {COPY_BY}, got {self.copy_by!r}")
        if self.copy_programs < 0:
            raise ValueError(f"EngineConfig.copy_programs must be >= 0, got {self.copy_programs}")
        if self.copy_piece_bytes < 0:
            raise ValueError(f"EngineConfig.copy_piece_bytes must be >= 0, got {self.copy_piece_bytes}")
        if self.num_slots < 1:
            raise ValueError(f"EngineConfig.num_slots must be >= 1, got {self.num_slots}")
        if self.write_threads is not None and self.write_threads < 1:
            raise ValueError(f"EngineConfig.write_threads must be >= 1, got {self.write_threads}")


@dataclass(kw_only=True)
class SnapshotRecord:
    """What one iteration's snapshot did (for metrics and the benchmark)."""

    iteration: int
    bytes: int
    num_full: int
    num_compute: int
    stall_s: float = 0.0
    """Host time the training thread waited: ``slot_wait_s`` plus the time spent in ``wait_copied``."""
    slot_wait_s: float = 0.0
    """Host time ``submit`` waited for a free buffer slot (the store writes slower than training runs)."""
    device_stall_s: float | None = None
    """GPU: time the compute stream waited for the copy (timing events); ``None`` on CPU or until known."""
    issue_s: float = 0.0
    """GPU: host time ``submit`` spent issuing the copies."""
    copy_s: float = 0.0
    """Copy time: device time of the side-stream copies on GPU, the thread's copy time on CPU."""
    write_s: float = 0.0
    thread_cpu_s: float = 0.0
    """CPU time the background thread spent on this snapshot (copy + write + publish + GC)."""
    entries_cpu_s: float = 0.0
    """The part of ``thread_cpu_s`` spent until the operators' entries were written (the rest: metadata
    entry, manifest, publish, garbage collection)."""
    published: bool = False
    skipped: str = ""
    """Why nothing was published (``"store full"``: the store's file system had no room; training went on)."""
    remote_bytes: int = 0
    """FULL bytes hashed but not written (left to the replica peers; ``bytes`` counts what was written)."""
    host_bytes_touched: int = 0
    """Payload bytes the trainer process's threads passed over on the host for this snapshot: a host copy
    into slot buffers (CPU path; a device-to-host DMA costs none), the checksum and the store write."""

    @property
    def trainer_payload_bytes_per_byte(self) -> float:
        """:attr:`host_bytes_touched` per snapshot byte (written or only hashed): 2 on the CPU direct path
        (checksum + write), 3 through slot buffers; the goal is the copy alone."""
        payload = self.bytes + self.remote_bytes
        return self.host_bytes_touched / payload if payload else 0.0


@dataclass(frozen=True)
class _Entry:
    """One (slot, operator, level): the live tensors, the slot's host buffers for them, and the mapping
    handed to the store. Built once and reused: the registry's views are fixed when it is built, and
    re-deriving dicts, buffer keys and byte counts every iteration is pure per-iteration Python cost.
    ``dev_*``: pairs copied on the side stream (GPU path); ``host_*``: host-resident sources."""

    op: OperatorId
    level: Level
    srcs: list
    bufs: list
    out: dict  # name -> host buffer, the store's input
    nbytes: int
    dev_srcs: list
    dev_bufs: list
    host_srcs: list
    host_bufs: list
    specs: tuple | None = None
    """:func:`moe_ft.store.codec.tensor_specs` of ``out`` on the CPU direct path (its tensors are fixed: the
    store lays the entry out from them at every snapshot); ``None``: the store computes them."""
    staged: list = field(default_factory=list)
    staged_from: list = field(default_factory=list)
    """Forward-mutated tensors (``OperatorState.forward_mutated``): the entry copies ``staged[i]``, which
    :meth:`SnapshotEngine.submit` refreshes from the live ``staged_from[i]`` on the compute stream."""


_LAID_CACHE = 256
"""Plans whose entries :meth:`SnapshotEngine._lay_out` keeps (per slot; a sparse window has ``W`` of them)."""


@dataclass(frozen=True, kw_only=True)
class _Laid:
    """One plan's entries in one slot, in operator order, with the record's totals (made once per plan)."""

    items: tuple  # (_Entry, ...)
    nbytes: int
    num_full: int
    num_compute: int
    remote_bytes: int
    remote: frozenset
    staged: list  # the forward-mutated tensors' copies (_Entry.staged) of every entry, and their sources
    staged_from: list


@dataclass(kw_only=True)
class _Job:
    record: SnapshotRecord
    slot: int
    items: list  # [_Entry]
    meta: dict
    meta_tensors: dict
    remote: frozenset = frozenset()  # operators whose FULL entry is only hashed (put_remote)
    meta_device: list = field(default_factory=list)  # [(host buffer, device clone)] copied on the stream
    copied: threading.Event = field(default_factory=threading.Event)
    deadline: threading.Event = field(default_factory=threading.Event)  # wait_copied: copy what is left now
    mapped: object = None  # MappedJob: the copies went straight into the store's regions (moe_ft/snapshot/mapped.py)
    skip: OSError | None = None  # the store had no room for the regions: nothing was copied
    cuda_event: object = None  # side stream: copies done
    start_event: object = None  # side stream: copies start
    reached_event: object = None  # compute stream: reached wait_copied


class SnapshotEngine:
    """Executes snapshot plans of one rank into ``store`` (a :class:`moe_ft.store.SnapshotStore`)."""

    def __init__(self, config: EngineConfig, registry, store) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        layout = {f"{op}/{name}": t.detach() for op in registry for name, t in registry[op].tensors(Level.FULL).items()}
        self.cuda = torch.cuda.is_available() and any(t.is_cuda for t in layout.values())
        self.direct = _direct_write(config, self.cuda, layout)
        self._stream = torch.cuda.Stream() if self.cuda else None
        self.mapped = None
        """GPU: a :class:`moe_ft.snapshot.mapped.MappedCopier` when the copies land in the store's regions
        (``mapped_off`` says why not)."""
        self.mapped_off = _mapped_off(config, self.cuda, store)
        if not self.mapped_off:
            pacer = CopyPacer(config.copy_piece_bytes) if config.copy_piece_bytes else None
            self.mapped = MappedCopier(store, self._stream, capacity=2 * len(layout), pacer=pacer,
                                       copy_by=config.copy_by, programs=config.copy_programs)
            if self.mapped.pinned.failed:  # a copy into pageable memory would block the host: stage instead
                self.mapped_off = f"page-locking the store's arena failed: {self.mapped.pinned.failed}"
                self.mapped.close()
                self.mapped = None
        if config.copy_piece_bytes and self.mapped is None:
            print(f"moe-ft snapshots: the copy is not paced (--ft-snapshot-copy-piece-mb): only copies into the "
                  f"store's regions are, and here {self.mapped_off}", file=sys.stderr, flush=True)
        if config.copy_by == "kernel" and self.mapped is None:
            print(f"moe-ft snapshots: the copy engine copies (--ft-snapshot-copy-by kernel needs copies into the "
                  f"store's regions, and here {self.mapped_off})", file=sys.stderr, flush=True)
        pin = self.cuda if config.pin_memory is None else config.pin_memory
        # every operator FULL (the largest plan); direct writes need buffers for the metadata only
        self.buffers = HostBuffers(config.num_slots, pin, None if self.direct or self.mapped else layout)
        self._free = queue.Queue()
        for slot in range(config.num_slots):
            self._free.put(slot)
        self._inflight: _Job | None = None
        threads = config.write_threads or (4 if self.cuda else 1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moe-ft-snapshot-write") if threads > 1 else None
        self._untimed: deque[_Job] = deque()  # GPU jobs whose device stall is not known yet
        self._entries: dict[tuple[int, OperatorId, Level], _Entry] = {}
        self._laid: dict[tuple, _Laid] = {}
        self.records: list[SnapshotRecord] = []
        self.paused: str = ""
        """Non-empty while snapshots are paused: the store's file system is full (``ENOSPC``/``EDQUOT``);
        each later snapshot tries again, and the first that fits resumes them."""
        # No torch-function mode on the worker (unlike threads that run Megatron code): it only copies
        # CPU/pinned tensors and writes bytes, and a Python-level mode would put every tensor access of it
        # under the GIL, slowing down the training thread it is meant to overlap with.
        self._worker: BackgroundWorker[_Job] = BackgroundWorker(
            "moe-ft-snapshot", self._execute, setup=lambda: torch.set_num_threads(1), after=self._job_done,
            describe=lambda e: f"snapshot engine failed: {e!r}")

    # ------------------------------------------------------------------------------- training thread
    def submit(self, iteration: int, plan: Mapping[OperatorId, Level], meta: dict,
               meta_tensors: Mapping[str, torch.Tensor], remote: frozenset[OperatorId] = frozenset()) -> SnapshotRecord:
        """Start the snapshot of ``iteration``: this rank's operators of ``plan`` at their level, plus the
        metadata entry. Returns at once (after a free buffer slot is available). ``meta_tensors`` are
        captured before returning (host ones copied, device ones cloned on the compute stream), so the
        caller may reuse them. ``remote``: operators FULL in ``plan`` whose FULL state the replica peers
        rebuild (MoEtion §5.2, ``--ft-optimizer-recompute-local compute``): their COMPUTE entry is written
        and their FULL entry only hashed (``PendingPoint.put_remote``)."""
        self._raise_if_failed()
        if self.config.bubbles is not None:  # the bubbles of the iteration that ended: the next one's estimate
            self.config.bubbles.end_iteration()
        start = time.perf_counter()
        slot = self._free.get()
        waited = time.perf_counter() - start
        # Only host-side bookkeeping happens here, on CPU tensors: leave any torch-function mode of the
        # training thread (the CPU compatibility layer's) out of it, it costs ~10 us per tensor access.
        with _no_torch_function(not self.cuda):
            laid = self._lay_out(slot, plan, remote)
            record = SnapshotRecord(iteration=iteration, bytes=laid.nbytes, num_full=laid.num_full,
                                    num_compute=laid.num_compute, stall_s=waited, slot_wait_s=waited,
                                    remote_bytes=laid.remote_bytes)
            job = _Job(record=record, slot=slot, items=list(laid.items), meta=dict(meta), meta_tensors={},
                       remote=laid.remote)
            self._stage_meta(job, meta_tensors)
            if laid.staged:  # written by the next forward: captured now, on the compute stream (_Entry.staged)
                torch._foreach_copy_(laid.staged, laid.staged_from)
        if self.mapped is not None:
            self._issue_mapped(job)
        elif self.cuda:
            self._copy_on_stream(job)
        self._inflight = job
        self.records.append(record)
        self._worker.submit(job)
        return record

    def _lay_out(self, slot: int, plan: Mapping[OperatorId, Level], remote: frozenset[OperatorId]) -> "_Laid":
        """The entries of ``plan`` in ``slot`` and their totals, made once per plan (a sparse window's plans
        repeat every window; each call would otherwise sort the plan and look up every entry again). Keyed by
        the plan's contents, not its identity: a caller may change a plan it handed in before."""
        remote = remote if isinstance(remote, frozenset) else frozenset(remote)
        key = (slot, tuple(plan.items()), remote)
        laid = self._laid.get(key)
        if laid is not None:
            return laid
        items, total, nfull, ncomp, hashed = [], 0, 0, 0, 0
        for op, level in sorted(plan.items()):
            if level == Level.NONE or op not in self.registry:
                continue
            if op in remote:
                if level != Level.FULL:
                    raise ValueError(f"{op}: only a FULL entry can be left to the replica peers (plan: "
                                     f"{Level(level).name})")
                entry = self._entry(slot, op, Level.FULL)
                items.append(self._entry(slot, op, Level.COMPUTE))
                total += items[-1].nbytes
                hashed += entry.nbytes
            else:
                entry = self._entry(slot, op, Level(level))
                total += entry.nbytes
            items.append(entry)
            nfull += level == Level.FULL
            ncomp += level == Level.COMPUTE
        if len(self._laid) >= _LAID_CACHE:  # reordered windows make new plans: keep the cache bounded
            self._laid.clear()
        laid = self._laid[key] = _Laid(
            items=tuple(items), nbytes=total, num_full=nfull, num_compute=ncomp, remote_bytes=hashed,
            remote=remote, staged=[b for e in items for b in e.staged],
            staged_from=[s for e in items for s in e.staged_from])
        return laid

    def _entry(self, slot: int, op: OperatorId, level: Level) -> _Entry:
        entry = self._entries.get((slot, op, level))
        if entry is None:
            state = self.registry[op]
            tensors = {name: src.detach() for name, src in state.tensors(level).items()}
            mutated = [name for name in tensors if name in getattr(state, "forward_mutated", ())]
            staged_from = [tensors[name] for name in mutated]
            for name in mutated:  # the entry reads a copy taken at submit (see _Entry.staged)
                tensors[name] = torch.empty_like(tensors[name])
            if self.mapped is not None:  # copied into the store's regions (mapped.py)
                out, srcs, bufs = tensors, list(tensors.values()), []
            elif self.direct:  # the store writes the live tensors; nothing to copy first
                out, srcs, bufs = tensors, [], []
            else:
                out = {name: self.buffers.view(slot, f"{op}/{name}") for name in tensors}
                srcs, bufs = list(tensors.values()), list(out.values())
            dev = [self.cuda and self.mapped is None and s.is_cuda for s in srcs]
            entry = _Entry(op=op, level=level, srcs=srcs, bufs=bufs, out=out,
                           nbytes=sum(t.nbytes for t in out.values()), specs=_specs(out) if self.direct else None,
                           dev_srcs=[s for s, d in zip(srcs, dev) if d], dev_bufs=[b for b, d in zip(bufs, dev) if d],
                           host_srcs=[s for s, d in zip(srcs, dev) if not d],
                           host_bufs=[b for b, d in zip(bufs, dev) if not d],
                           staged=[tensors[name] for name in mutated], staged_from=staged_from)
            self._entries[(slot, op, level)] = entry
        return entry

    def _stage_meta(self, job: _Job, meta_tensors: Mapping[str, torch.Tensor]) -> None:
        """Capture the metadata tensors (RNG states, popularity counters: small) into the slot's buffers:
        host tensors by a host copy now; device tensors by a clone on the compute stream (no host sync),
        copied to the host on the side stream with the operators (GPU path) or at once (CPU path)."""
        host_bufs, host_srcs = [], []
        for name, t in meta_tensors.items():
            t = t.detach()
            buf = self.buffers.get_meta(job.slot, f"meta/{name}", t)
            job.meta_tensors[name] = buf
            if t.is_cuda and self.cuda:
                job.meta_device.append((buf, t.clone()))
            else:
                host_bufs.append(buf)
                host_srcs.append(t if t.device.type == "cpu" else t.cpu())
        if host_bufs:
            torch._foreach_copy_(host_bufs, host_srcs)

    def wait_copied(self) -> float:
        """Make the next optimizer step wait until the in-flight snapshot no longer needs the live tensors;
        call right before it. CPU: blocks until the thread's copy is done. GPU: the compute stream waits on
        the copy event, the host does not. Returns (and records) the host stall in seconds."""
        job = self._inflight
        if job is None:
            return 0.0
        start = time.perf_counter()
        if job.cuda_event is not None:
            job.reached_event = _timing_event()
            job.reached_event.record()
            torch.cuda.current_stream().wait_event(job.cuda_event)
            self._untimed.append(job)
        else:
            job.deadline.set()
            if self.config.bubbles is not None:
                self.config.bubbles.gate.poke()
            while not job.copied.wait(timeout=1.0):
                self._raise_if_failed()
        stall = time.perf_counter() - start
        job.record.stall_s += stall
        self._inflight = None
        self._resolve_device_stalls(block=False)
        self._raise_if_failed()
        return stall

    def flush(self) -> None:
        """Wait until every submitted snapshot is published (or raise the engine's error)."""
        job = self._inflight
        if job is not None and self.config.bubbles is not None:  # no later bubble will come: copy it now
            job.deadline.set()
            self.config.bubbles.gate.poke()
        self._worker.drain()
        self._resolve_device_stalls(block=True)

    def close(self) -> None:
        """Flush, then stop the background thread and release the page-locked buffers."""
        try:
            self.flush()
        finally:
            self._worker.close(timeout=60)
            if self._pool is not None:
                self._pool.shutdown()
            if self._stream is not None:
                self._stream.synchronize()
            if self.mapped is not None:
                self.mapped.close()
            self.buffers.release()

    def _raise_if_failed(self) -> None:
        self._worker.raise_if_failed()

    def _copy_on_stream(self, job: _Job) -> None:
        """Issue the job's copies on the side stream, ordered after everything queued on the compute
        stream so far (the optimizer step of this iteration); no host synchronisation."""
        start = time.perf_counter()
        dev_bufs = [b for entry in job.items for b in entry.dev_bufs]
        dev_srcs = [s for entry in job.items for s in entry.dev_srcs]
        host_bufs = [b for entry in job.items for b in entry.host_bufs]
        if host_bufs:  # host-resident state (e.g. a CPU step counter) is final once the step was issued
            torch._foreach_copy_(host_bufs, [s for entry in job.items for s in entry.host_srcs])
        for buf, clone in job.meta_device:
            dev_bufs.append(buf)
            dev_srcs.append(clone)
        self._stream.wait_stream(torch.cuda.current_stream())
        job.start_event, job.cuda_event = _timing_event(), _timing_event()
        with torch.cuda.stream(self._stream):
            job.start_event.record(self._stream)
            if dev_bufs:  # one dispatch for the whole slot
                torch._foreach_copy_(dev_bufs, dev_srcs, non_blocking=True)
            job.cuda_event.record(self._stream)
        for _, clone in job.meta_device:
            clone.record_stream(self._stream)  # the allocator must not reuse it before the copy ran
        job.meta_device = []
        job.record.issue_s = time.perf_counter() - start

    def _issue_mapped(self, job: _Job) -> None:
        """GPU into the store (``moe_ft/snapshot/mapped.py``): reserve the point's regions, queue the copies
        into them and the device checksums on the side stream, after the compute stream's work so far."""
        start = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream())
        job.start_event, job.cuda_event = _timing_event(), _timing_event()
        with torch.cuda.stream(self._stream):
            job.start_event.record(self._stream)
            try:
                job.mapped = self.mapped.issue(job.record.iteration, job.slot, job.items, job.remote)
            except OSError as e:
                if not store_full(e):
                    raise
                job.skip = e
            if job.meta_device:
                torch._foreach_copy_([b for b, _ in job.meta_device], [c for _, c in job.meta_device],
                                     non_blocking=True)
            job.cuda_event.record(self._stream)
        for _, clone in job.meta_device:
            clone.record_stream(self._stream)
        job.meta_device = []
        job.record.issue_s = time.perf_counter() - start

    def _resolve_device_stalls(self, block: bool) -> None:
        """Fill ``device_stall_s`` of GPU jobs whose events completed (all of them with ``block``)."""
        while self._untimed:
            job = self._untimed[0]
            if block:
                job.reached_event.synchronize()
                job.cuda_event.synchronize()
            elif not (job.reached_event.query() and job.cuda_event.query()):
                return
            self._untimed.popleft()
            job.record.device_stall_s = max(0.0, job.reached_event.elapsed_time(job.cuda_event)) / 1e3

    # ----------------------------------------------------------------------------- background thread
    def _job_done(self, job: _Job, error: BaseException | None) -> None:
        """After every job, handled or skipped: its slot is free again; after a failure nobody waits for
        its copy (``wait_copied`` raises the error instead). A job skipped after a failure may still have its
        device copy in flight: its regions and slot are given back only once the copy ended, so that no later
        point (an in-process recovery keeps the store) is written into by a stale copy."""
        if error is not None:
            job.copied.set()
            if job.cuda_event is not None:
                with contextlib.suppress(RuntimeError):  # a failed device: nothing more will be copied
                    job.cuda_event.synchronize()
            if job.mapped is not None:
                job.mapped.point.abort()  # type: ignore[attr-defined]
        self._free.put(job.slot)

    @torch.no_grad()
    def _execute(self, job: _Job) -> None:
        cpu0 = time.thread_time()
        start = time.perf_counter()
        if job.cuda_event is not None:
            job.cuda_event.synchronize()
            job.record.copy_s = job.start_event.elapsed_time(job.cuda_event) / 1e3
        elif self.config.bubbles is not None:
            job.record.copy_s = self._copy_in_bubbles(job, self.config.bubbles)
            job.record.host_bytes_touched += sum(e.nbytes for e in job.items)
        elif not self.direct:
            _copy_entries(job.items)
            job.record.copy_s = time.perf_counter() - start
            job.record.host_bytes_touched += sum(e.nbytes for e in job.items)
        if not self.direct:
            job.copied.set()
        start = time.perf_counter()
        try:
            if job.skip is not None:
                raise job.skip
            pool_cpu = self._write(job, cpu0, start)
        except OSError as e:
            if not store_full(e):
                raise
            job.copied.set()  # nothing more will be read from the live tensors
            self._pause(job.record, e)
            return
        if self.paused:
            print(f"moe-ft snapshots resumed at iteration {job.record.iteration}: {self.store.backend.describe()} "
                  "has room again", file=sys.stderr, flush=True)
            self.paused = ""
        job.record.write_s = time.perf_counter() - start
        job.record.thread_cpu_s = time.thread_time() - cpu0 + pool_cpu
        job.record.published = True

    def _write(self, job: _Job, cpu0: float, start: float) -> float:
        """Write and publish the job's point (a failure aborts it: nothing of it is visible); returns the
        write pool's CPU seconds."""
        if job.mapped is not None:
            with job.mapped.point as point:  # type: ignore[attr-defined]
                self.mapped.seal(job.mapped)
                job.record.entries_cpu_s = time.thread_time() - cpu0
                point.put_meta(job.meta, job.meta_tensors)
                point.publish()
                job.record.host_bytes_touched += point.touched + job.mapped.host_bytes  # type: ignore[attr-defined]
            return 0.0
        pool_cpu = 0.0
        with self.store.begin(job.record.iteration) as point:
            if self._pool is not None and len(job.items) > 1:
                # largest entries first: the pool's threads finish together
                items = sorted(job.items, key=lambda e: -e.nbytes)
                pool_cpu = _put_all(self._pool, point, items, job.remote)
            else:
                for entry in job.items:
                    _put(point, entry, job.remote)
            job.record.entries_cpu_s = time.thread_time() - cpu0 + pool_cpu
            if self.direct:  # the live tensors are written: the next optimizer step may change them
                job.record.copy_s = time.perf_counter() - start
                job.copied.set()
            point.put_meta(job.meta, job.meta_tensors)
            point.publish()
            job.record.host_bytes_touched += point.touched
        return pool_cpu

    def _pause(self, record: SnapshotRecord, error: OSError) -> None:
        """The store is full: this snapshot is dropped (its staging was aborted: no torn point), training
        goes on, the next snapshots try again. Recovery meanwhile uses the newest recoverable point kept
        (retention never deleted one for a point that was not published)."""
        record.skipped = "store full"
        if not self.paused:
            print(f"moe-ft snapshots paused (store full) at iteration {record.iteration}: {self.store.backend.describe()}: "
                  f"{error.strerror}; training goes on, snapshots resume when space returns (free space on the "
                  "store's file system, or --ft-store-dir on a larger one)", file=sys.stderr, flush=True)
        self.paused = "store full"

    def _copy_in_bubbles(self, job: _Job, schedule) -> float:
        """MoEtion Alg. 4 on the CPU path: ``W*`` at once (overlapping computation), then each entry of
        ``W_bubble`` when the stage is idle in a pipeline exchange, or at the deadline (``wait_copied``).
        Returns the seconds spent copying (waits excluded)."""
        items = sorted(job.items, key=lambda e: -e.nbytes)  # big entries first: fewer, longer bubble pieces
        n_bubble = schedule.split([e.nbytes for e in items])
        bubble, star = items[:n_bubble], items[n_bubble:]
        it = job.record.iteration
        start = time.perf_counter()
        _copy_entries(star)
        copy_s = time.perf_counter() - start
        for entry in star:
            schedule.record(iteration=it, op=str(entry.op), kind="compute", start=start, end=start + copy_s,
                            bytes=entry.nbytes)
        for entry in bubble:
            in_bubble = schedule.gate.wait_open(job.deadline)
            t0 = time.perf_counter()
            _copy_entries([entry])
            t1 = time.perf_counter()
            copy_s += t1 - t0
            schedule.record(iteration=it, op=str(entry.op), kind="bubble" if in_bubble else "forced",
                            start=t0, end=t1, bytes=entry.nbytes)
        schedule.observe_copy(sum(e.nbytes for e in items), copy_s)
        return copy_s


def _direct_write(config: EngineConfig, cuda: bool, layout: Mapping[str, torch.Tensor]) -> bool:
    """Whether the engine writes live tensors directly (``EngineConfig.direct_write``)."""
    possible = not cuda and config.bubbles is None and all(t.is_contiguous() for t in layout.values())
    if config.direct_write is None:
        return possible
    if config.direct_write and not possible:
        raise ValueError("EngineConfig.direct_write needs a CPU registry of contiguous tensors and no bubble "
                         "schedule (the GPU path copies into pinned buffers, bubble-aware copies into slot "
                         "buffers); leave it None to choose automatically")
    return config.direct_write


def _mapped_off(config: EngineConfig, cuda: bool, store) -> str:
    """Why the GPU path does not copy into the store's regions (``""``: it does)."""
    if not cuda:
        return "the registry is not on CUDA"
    if config.direct_write is False:
        return "direct writes are off (EngineConfig.direct_write)"
    if config.bubbles is not None:
        return "bubble-aware copies go through slot buffers"
    return available(store, cuda)


def _specs(out: Mapping[str, torch.Tensor]) -> tuple | None:
    """:func:`tensor_specs` of an entry's tensors, ``None`` for a dtype the store refuses (its ``put`` then says
    which, at the snapshot)."""
    try:
        return tensor_specs(out)
    except ValueError:
        return None


def _copy_entries(entries) -> None:
    """Copy the entries' live tensors into their host buffers: one dispatch for all of them."""
    bufs = [buf for entry in entries for buf in entry.bufs]
    if bufs:
        torch._foreach_copy_(bufs, [src for entry in entries for src in entry.srcs])


def _put(point, entry: _Entry, remote: frozenset) -> None:
    """Write one entry, or only hash it (a FULL entry the replica peers rebuild)."""
    if entry.level == Level.FULL and entry.op in remote:
        point.put_remote(entry.op, entry.out)
    else:
        point.put(entry.op, entry.level, entry.out, entry.specs)


def _put_timed(point, entry: _Entry, remote: frozenset) -> float:
    """:func:`_put` on a pool thread; returns the thread's CPU seconds."""
    cpu0 = time.thread_time()
    _put(point, entry, remote)
    return time.thread_time() - cpu0


def _put_all(pool: ThreadPoolExecutor, point, items: list[_Entry], remote: frozenset) -> float:
    """:func:`_put` of every entry on the pool; returns the threads' CPU seconds. When one fails (a full store),
    the entries not started are cancelled and those started are waited for before the error is raised: the
    point is aborted only after its last write ended, so that no thread still writes into regions the abort
    returned (the next point would get them and be published torn)."""
    futures = [pool.submit(_put_timed, point, e, remote) for e in items]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = [f for f in futures if f in done and f.exception() is not None]
    if failed:
        for f in futures:
            f.cancel()
        wait(futures)
        raise failed[0].exception()  # type: ignore[misc]
    return sum(f.result() for f in futures)


def _timing_event() -> torch.cuda.Event:
    """A timing event whose host wait sleeps (``cudaEventBlockingSync``). The background thread waits on the copy
    event of every snapshot (``_execute``) for as long as the copy and the hash kernel run (~14 ms for 673 MB at
    48 GB/s); on a default event ``synchronize`` busy-waits all that time (CUDA runtime API,
    ``cudaEventSynchronize``): a core spinning in the driver beside the launch-bound training thread, counted in
    ``SnapshotRecord.thread_cpu_s``. Waking from a blocking wait takes microseconds longer, which the background
    thread can afford; device-side waits (``wait_event``) and the timings do not change."""
    return torch.cuda.Event(enable_timing=True, blocking=True)


def _no_torch_function(enabled: bool):
    """Disable torch-function handling (modes and subclasses) in this block; a null context otherwise."""
    return torch._C.DisableTorchFunction() if enabled else contextlib.nullcontext()
