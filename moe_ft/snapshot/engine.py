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
    published: bool = False


@dataclass(kw_only=True)
class _Job:
    record: SnapshotRecord
    slot: int
    items: list  # (op, level, {name: (src, buffer)})
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
        self.records: list[SnapshotRecord] = []
        self._thread = threading.Thread(target=self._run, name="moe-ft-snapshot", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- training thread
    def submit(self, iteration: int, plan: Mapping[OperatorId, Level], meta: dict,
               meta_tensors: Mapping[str, torch.Tensor]) -> SnapshotRecord:
        """Start the snapshot of ``iteration``: this rank's operators of ``plan`` at their level, plus the
        metadata entry. Returns at once (after a free buffer slot is available)."""
        self._raise_if_failed()
        start = time.perf_counter()
        slot = self._free.get()
        waited = time.perf_counter() - start
        items, total, nfull, ncomp = [], 0, 0, 0
        for op, level in sorted(plan.items()):
            if level == Level.NONE or op not in self.registry:
                continue
            pairs = {name: (src, self.buffers.get(slot, f"{op}/{name}", src))
                     for name, src in self.registry[op].tensors(level).items()}
            items.append((op, Level(level), pairs))
            total += sum(src.nbytes for src, _ in pairs.values())
            nfull += level == Level.FULL
            ncomp += level == Level.COMPUTE
        record = SnapshotRecord(iteration=iteration, bytes=total, num_full=nfull, num_compute=ncomp, stall_s=waited)
        job = _Job(record=record, slot=slot, items=items, meta=dict(meta),
                   meta_tensors={k: v.detach().cpu().clone() for k, v in meta_tensors.items()})
        if self.cuda:
            self._copy_on_stream(job)
        self._inflight = job
        self.records.append(record)
        self._jobs.put(job)
        return record

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
            for _, _, pairs in job.items:
                for src, buf in pairs.values():
                    buf.copy_(src.detach(), non_blocking=True)
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record(self._stream)
        job.record.copy_s = time.perf_counter() - start

    # ----------------------------------------------------------------------------- background thread
    def _run(self) -> None:
        from moe_ft.compat.cpu import enter_device_mode_in_thread

        torch.set_num_threads(1)
        with enter_device_mode_in_thread():
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
        start = time.perf_counter()
        if job.cuda_event is not None:
            job.cuda_event.synchronize()
        else:
            for _, _, pairs in job.items:
                for src, buf in pairs.values():
                    buf.copy_(src.detach())
            job.record.copy_s = time.perf_counter() - start
        job.copied.set()
        start = time.perf_counter()
        with self.store.begin(job.record.iteration) as point:
            for op, level, pairs in job.items:
                point.put(op, level, {name: buf for name, (_, buf) in pairs.items()})
            point.put_meta(job.meta, job.meta_tensors)
            point.publish()
        job.record.write_s = time.perf_counter() - start
        job.record.published = True
