"""Snapshot engine (SPEC §4; MoEvement §3.2 "snapshots overlap the next iteration's forward/backward";
MoC §5.2 asynchronous snapshotting): executes a plan, never decides one.

Timeline of iteration ``t`` (the state after the update of ``t`` is what the snapshot of ``t`` holds)::

    optimizer.step(t) → submit(t, plan)  ──copy→ host buffers──►  ──write→ store, publish──►
                        forward/backward(t+1) runs meanwhile
                        wait_copied() ← right before optimizer.step(t+1); the wait is the *stall*

* **CPU**: a background thread copies the plan's tensors into host buffers and then writes them to the
  store. Forward/backward only read the weights, so copying overlaps them; the next optimizer step waits
  for the copy (not the write) to finish.
* **GPU**: the copies are issued on a dedicated CUDA stream into pinned buffers (after the stream waits
  for the compute stream) and an event is recorded; ``wait_copied`` waits for that event; the background
  thread waits for the event too and then writes.

Buffers: ``num_slots`` host buffer sets allocated once and reused (:class:`HostBuffers`); ``submit``
waits for a free slot when the store is slower than training (that wait is counted as stall as well).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch

from moe_ft.snapshot.buffers import HostBuffers
from moe_ft.state.operators import Level, OperatorId


@dataclass(kw_only=True)
class EngineConfig:
    """Snapshot engine knobs."""

    num_slots: int = 2
    """Host buffer sets; 2 lets the copy of ``t+1`` start while ``t`` is still being written."""
    pin_memory: bool | None = None
    """Pin host buffers; ``None``: pin iff CUDA is available (pinning needs a device)."""

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"EngineConfig.num_slots must be >= 1, got {self.num_slots}")


@dataclass(kw_only=True)
class SnapshotRecord:
    """What one iteration's snapshot did (for metrics and the benchmark)."""

    iteration: int
    bytes: int
    num_full: int
    num_compute: int
    stall_s: float = 0.0
    copy_s: float = 0.0
    write_s: float = 0.0
    thread_cpu_s: float = 0.0
    """CPU time the background thread spent on this snapshot (copy + write + publish + GC)."""
    published: bool = False


@dataclass(frozen=True)
class _Entry:
    """One (slot, operator, level): the live tensors, the slot's host buffers for them, and the mapping
    handed to the store. Built once and reused: the registry's views are fixed when it is built, and
    re-deriving dicts, buffer keys and byte counts every iteration is pure per-iteration Python cost."""

    op: OperatorId
    level: Level
    srcs: list
    bufs: list
    out: dict  # name -> host buffer, the store's input
    nbytes: int


@dataclass(kw_only=True)
class _Job:
    record: SnapshotRecord
    slot: int
    items: list  # [_Entry]
    meta: dict
    meta_tensors: dict
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_event: object = None


class SnapshotEngine:
    """Executes snapshot plans of one rank into ``store`` (a :class:`moe_ft.store.SnapshotStore`)."""

    def __init__(self, config: EngineConfig, registry, store) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.cuda = torch.cuda.is_available()
        pin = self.cuda if config.pin_memory is None else config.pin_memory
        self.buffers = HostBuffers(config.num_slots, pin)
        self._free = queue.Queue()
        for slot in range(config.num_slots):
            self._free.put(slot)
        self._jobs: queue.Queue = queue.Queue()
        self._inflight: _Job | None = None
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream() if self.cuda else None
        self._entries: dict[tuple[int, OperatorId, Level], _Entry] = {}
        self.records: list[SnapshotRecord] = []
        self._thread = threading.Thread(target=self._run, name="moe-ft-snapshot", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- training thread
    def submit(self, iteration: int, plan: Mapping[OperatorId, Level], meta: dict,
               meta_tensors: Mapping[str, torch.Tensor]) -> SnapshotRecord:
        """Start the snapshot of ``iteration``: this rank's operators of ``plan`` at their level, plus the
        metadata entry. Returns at once (after a free buffer slot is available). ``meta_tensors`` are
        copied into the slot's host buffers before returning, so the caller may reuse them."""
        self._raise_if_failed()
        start = time.perf_counter()
        slot = self._free.get()
        waited = time.perf_counter() - start
        # Only host-side bookkeeping happens here, on CPU tensors: leave any torch-function mode of the
        # training thread (the CPU compatibility layer's) out of it, it costs ~10 us per tensor access.
        with _no_torch_function(not self.cuda):
            items, total, nfull, ncomp = [], 0, 0, 0
            for op, level in sorted(plan.items()):
                if level == Level.NONE or op not in self.registry:
                    continue
                entry = self._entry(slot, op, Level(level))
                items.append(entry)
                total += entry.nbytes
                nfull += level == Level.FULL
                ncomp += level == Level.COMPUTE
            record = SnapshotRecord(iteration=iteration, bytes=total, num_full=nfull, num_compute=ncomp,
                                    stall_s=waited)
            job = _Job(record=record, slot=slot, items=items, meta=dict(meta),
                       meta_tensors=self._stage_meta(slot, meta_tensors))
        if self.cuda:
            self._copy_on_stream(job)
        self._inflight = job
        self.records.append(record)
        self._jobs.put(job)
        return record

    def _entry(self, slot: int, op: OperatorId, level: Level) -> _Entry:
        entry = self._entries.get((slot, op, level))
        if entry is None:
            tensors = {name: src.detach() for name, src in self.registry[op].tensors(level).items()}
            out = {name: self.buffers.get(slot, f"{op}/{name}", src) for name, src in tensors.items()}
            entry = _Entry(op=op, level=level, srcs=list(tensors.values()), bufs=list(out.values()), out=out,
                           nbytes=sum(src.nbytes for src in tensors.values()))
            self._entries[(slot, op, level)] = entry
        return entry

    def _stage_meta(self, slot: int, meta_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy the metadata tensors (RNG states, popularity counters: small) into the slot's buffers."""
        srcs = [t.detach() for t in meta_tensors.values()]
        srcs = [t if t.device.type == "cpu" else t.cpu() for t in srcs]
        bufs = [self.buffers.get(slot, f"meta/{name}", src) for name, src in zip(meta_tensors, srcs)]
        if bufs:
            torch._foreach_copy_(bufs, srcs)
        return dict(zip(meta_tensors, bufs))

    def wait_copied(self) -> float:
        """Block until the in-flight snapshot no longer needs the live tensors; returns (and records) the
        stall in seconds. Call right before the optimizer step that modifies them."""
        job = self._inflight
        if job is None:
            return 0.0
        start = time.perf_counter()
        if job.cuda_event is not None:
            job.cuda_event.synchronize()
        else:
            while not job.copied.wait(timeout=1.0):
                self._raise_if_failed()
        stall = time.perf_counter() - start
        job.record.stall_s += stall
        self._inflight = None
        self._raise_if_failed()
        return stall

    def flush(self) -> None:
        """Wait until every submitted snapshot is published (or raise the engine's error)."""
        self._jobs.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, then stop the background thread."""
        try:
            self.flush()
        finally:
            self._jobs.put(None)
            self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"snapshot engine failed: {self._error!r}") from self._error

    def _copy_on_stream(self, job: _Job) -> None:
        start = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for entry in job.items:
                for src, buf in zip(entry.srcs, entry.bufs):
                    buf.copy_(src, non_blocking=True)
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record(self._stream)
        job.record.copy_s = time.perf_counter() - start

    # ----------------------------------------------------------------------------- background thread
    def _run(self) -> None:
        # No torch-function mode here (unlike threads that run Megatron code): this thread only copies
        # CPU/pinned tensors and writes bytes, and a Python-level mode would put every tensor access of
        # it under the GIL, slowing down the training thread it is meant to overlap with.
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if self._error is None:
                    self._execute(job)
            except BaseException as exc:  # reported to the training thread on its next call
                self._error = exc
                job.copied.set()
            finally:
                self._free.put(job.slot)
                self._jobs.task_done()

    @torch.no_grad()
    def _execute(self, job: _Job) -> None:
        cpu0 = time.thread_time()
        start = time.perf_counter()
        if job.cuda_event is not None:
            job.cuda_event.synchronize()
        else:
            bufs = [buf for entry in job.items for buf in entry.bufs]
            if bufs:  # one dispatch for all tensors instead of one Python call per tensor
                torch._foreach_copy_(bufs, [src for entry in job.items for src in entry.srcs])
            job.record.copy_s = time.perf_counter() - start
        job.copied.set()
        start = time.perf_counter()
        with self.store.begin(job.record.iteration) as point:
            for entry in job.items:
                point.put(entry.op, entry.level, entry.out)
            point.put_meta(job.meta, job.meta_tensors)
            point.publish()
        job.record.write_s = time.perf_counter() - start
        job.record.thread_cpu_s = time.thread_time() - cpu0
        job.record.published = True


def _no_torch_function(enabled: bool):
    """Disable torch-function handling (modes and subclasses) in this block; a null context otherwise."""
    return torch._C.DisableTorchFunction() if enabled else contextlib.nullcontext()
