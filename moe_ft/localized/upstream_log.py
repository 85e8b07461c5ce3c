"""Upstream logging at the p2p seam of Megatron-Core's pipeline schedules (MoEvement §3.4).

Megatron-Core 0.16.1's schedules (``forward_backward_pipelining_without_interleaving`` and
``..._with_interleaving``) build their ``P2PCommunicator(pp_group=..., config=...)`` from the name
``P2PCommunicator`` in ``megatron.core.pipeline_parallel.schedules`` when the caller passes none (our
training loop passes none), and every send or receive of every public method (``send_forward``,
``send_forward_recv_backward``, ``send_forward_backward_recv_forward_backward``, ...) goes through
``P2PCommunicator._communicate``. :class:`P2PSeam` installs a subclass there (a factory bound to the seam)
whose ``_communicate`` hands every call to the seam:

* with a :class:`LogRecorder` attached, the tensors this stage *sends* are copied to host memory, keyed
  (iteration, direction, peer, send order) with the virtual stage of the sending chunk, and published to the
  rank's :class:`~moe_ft.localized.log_store.LogDir` at the end of the iteration (by a background thread
  for the runtime: the training thread neither waits for the device copies nor writes);
* with a replay handler attached (:class:`moe_ft.localized.log_replay.LogReplay`), receives from ranks that
  do not replay are filled from their logs and sends to them are dropped.

The seam is explicit state owned by whoever installed it (the runtime component, a test); nothing here is a
module global. Megatron's code is not copied: the subclass only routes the call.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable

import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from moe_ft.background import BackgroundWorker
from moe_ft.localized.log_store import BWD, FWD, CollectiveResult, IterationLog, LogDir
from moe_ft.localized.vstages import comm_layout, sending_vstage
from moe_ft.store.errors import store_full


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned and asynchronous on CUDA; the recorder waits for the copies, on an
    event recorded at the end of the iteration, before publishing)."""
    t = tensor.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class LogRecorder:
    """Collects one iteration's sends and stage-spanning collective results and publishes them.

    Only calls made on the thread that began the iteration are recorded (background threads of the
    replication or persistence tiers have their own groups and must not shift the call order).

    ``background``: :meth:`end` hands the iteration to a writer thread, which waits for its device copies
    (a CUDA event recorded at :meth:`end`, not a device synchronize) and publishes it; :meth:`run_after`
    queues other work on the log directory behind the writes (retention), :meth:`flush` waits for all of
    it. Without it, :meth:`end` publishes before returning."""

    KEEP_BYTES = 64
    """Iterations whose logged byte counts are remembered (metrics)."""

    def __init__(self, log_dir: LogDir, *, background: bool = False) -> None:
        self.log_dir = log_dir
        self._worker: BackgroundWorker | None = None
        if background:
            self._worker = BackgroundWorker("moe-ft-upstream-log", self._handle,
                                            describe=lambda e: f"upstream log writer failed: {e!r}")
        self.current: IterationLog | None = None
        self._thread: int | None = None
        self._cuda = False
        self.paused = False
        """The store was full at the last write: iterations are not logged until a write succeeds."""
        self.bytes_per_iteration: dict[int, int] = {}
        """Tensor bytes logged per published iteration, the newest ``KEEP_BYTES`` (the FT log line reports the
        newest)."""

    @property
    def active(self) -> bool:
        return self.current is not None and threading.get_ident() == self._thread

    def begin(self, iteration: int) -> None:
        self.current = IterationLog(iteration)
        self._thread = threading.get_ident()
        self._cuda = False

    def record_send(self, direction: str, peer: int, vstage: int, tensor: torch.Tensor) -> None:
        self._cuda |= tensor.is_cuda
        self.current.sends.setdefault((direction, peer), []).append((vstage, _host_copy(tensor)))

    def record_collective(self, ranks: tuple[int, ...], fn: str, outputs: list[torch.Tensor]) -> None:
        self._cuda |= any(t.is_cuda for t in outputs)
        self.current.collectives.setdefault(ranks, []).append(CollectiveResult(fn, [_host_copy(t) for t in outputs]))

    def end(self) -> int:
        """Publish the current iteration, or queue it (``background``); tensor bytes logged (0 when nothing
        was begun, or when the store is full)."""
        log, self.current = self.current, None
        if log is None:
            return 0
        if self._worker is None:
            if self._cuda:
                torch.cuda.synchronize()  # the pinned copies were asynchronous
            return self._publish(log)
        self._worker.raise_if_failed()
        event = None
        if self._cuda:  # the copies were queued on the current stream: publish once they are done
            event = torch.cuda.Event(blocking=True)  # the writer sleeps in its wait, never spins beside training
            event.record()
        self._worker.submit(lambda: self._publish(log, event))
        return log.nbytes()

    def run_after(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` after the iterations ended so far are published (at once without ``background``)."""
        if self._worker is None:
            fn()
        else:
            self._worker.raise_if_failed()
            self._worker.submit(fn)

    def flush(self) -> None:
        """Wait until every ended iteration is published (raises the writer's error, if any)."""
        if self._worker is not None:
            self._worker.drain()

    def close(self) -> None:
        """Publish what is queued, then stop the writer thread."""
        if self._worker is not None:
            self._worker.close()
            self._worker.raise_if_failed()

    @staticmethod
    def _handle(task: Callable[[], object]) -> None:
        task()

    def _publish(self, log: IterationLog, event=None) -> int:
        if event is not None:
            event.synchronize()
        try:
            self.log_dir.write(log)
        except OSError as e:
            if not store_full(e):
                raise
            if not self.paused:  # a replay that needs this iteration falls back to the global path
                print(f"moe-ft upstream log paused (store full) at iteration {log.iteration}: {e.strerror}; "
                      "training goes on", file=sys.stderr, flush=True)
            self.paused = True
            return 0
        if self.paused:
            print(f"moe-ft upstream log resumed at iteration {log.iteration}", file=sys.stderr, flush=True)
            self.paused = False
        self.bytes_per_iteration[log.iteration] = log.nbytes()
        for old in sorted(self.bytes_per_iteration)[:-self.KEEP_BYTES]:
            del self.bytes_per_iteration[old]
        return self.bytes_per_iteration[log.iteration]

    def abandon(self) -> None:
        """Drop the current iteration unpublished (a failed step)."""
        self.current = None


class SeamP2PCommunicator(P2PCommunicator):
    """Megatron's ``P2PCommunicator`` whose ``_communicate`` is routed through a :class:`P2PSeam`."""

    def __init__(self, pp_group, config, *, seam: "P2PSeam") -> None:
        super().__init__(pp_group, config)
        self.seam = seam
        self.num_sends = {FWD: 0, BWD: 0}
        """Non-empty sends per direction so far; the schedules build one communicator per call, so these count
        within one iteration's schedule (the sending chunk follows from them: ``moe_ft/localized/vstages.py``)."""

    def _communicate(self, **kwargs):
        return self.seam.communicate(self, super()._communicate, **kwargs)


class P2PSeam:
    """Routes every p2p call of Megatron's schedules through the attached recorder and replay handler."""

    def __init__(self) -> None:
        self.recorder: LogRecorder | None = None
        self.replay = None
        """A handler with ``active`` and ``communicate(comm, real, **kwargs)`` (``LogReplay``), or ``None``."""
        self.idle_gates: list = []
        """Objects with ``enter()``/``leave()`` called around each exchange with a neighbour (the stage
        waits: bubble-aware snapshots, ``moe_ft/snapshot/bubbles.py``)."""
        self._schedules = None
        self._original = None

    @staticmethod
    def current() -> "P2PSeam | None":
        """The seam installed in Megatron's schedules, if any (one per process; components share it)."""

        factory = schedules.P2PCommunicator
        if isinstance(factory, functools.partial) and factory.func is SeamP2PCommunicator:
            return factory.keywords["seam"]
        return None

    def install(self) -> "P2PSeam":
        if self.current() is not None:
            raise RuntimeError("a P2PSeam is already installed in megatron.core.pipeline_parallel.schedules; "
                               "share it (P2PSeam.current()) instead of installing a second one")
        self._schedules, self._original = schedules, schedules.P2PCommunicator
        schedules.P2PCommunicator = functools.partial(SeamP2PCommunicator, seam=self)
        return self

    def uninstall(self) -> None:
        if self._schedules is not None:
            self._schedules.P2PCommunicator = self._original
            self._schedules = self._original = None

    @staticmethod
    def vstage(comm: P2PCommunicator, direction: str | None = None) -> int:
        """Virtual stage of the chunk that sends: ``chunk * pp_size + pp_rank`` (Megatron's numbering). With
        one chunk per rank it is the pipeline rank. With virtual pipeline stages the chunk is not visible at
        this seam; it follows from the count of ``direction`` sends this schedule call made so far
        (:func:`moe_ft.localized.vstages.sending_vstage`; ``-1`` for a communicator without that count)."""
        layout = comm_layout(comm)
        if layout is None:
            return comm.pp_group.rank()
        sent = getattr(comm, "num_sends", None)
        if sent is None or direction is None:
            return -1
        pp_size, num_chunks, group = layout
        return sending_vstage(pp_rank=comm.pp_group.rank(), pp_size=pp_size, num_chunks=num_chunks,
                              group_size=group, direction=direction, send_idx=sent[direction])

    def _exchange(self, real):
        """``real`` with the idle gates open while it runs (the stage waits for its neighbour)."""
        gates = list(self.idle_gates)
        if not gates:
            return real

        def exchange(**kwargs):
            for gate in gates:
                gate.enter()
            try:
                return real(**kwargs)
            finally:
                for gate in gates:
                    gate.leave()

        return exchange

    def communicate(self, comm: P2PCommunicator, real, **kwargs):
        real, replay = self._exchange(real), self.replay
        result = replay.communicate(comm, real, **kwargs) if replay is not None and replay.active else real(**kwargs)
        rec = self.recorder
        for direction, key, peer in ((FWD, "tensor_send_next", comm.next_rank),
                                     (BWD, "tensor_send_prev", comm.prev_rank)):
            if kwargs.get(key) is None:
                continue
            if rec is not None and rec.active:
                rec.record_send(direction, peer, self.vstage(comm, direction), kwargs[key])
            if hasattr(comm, "num_sends"):
                comm.num_sends[direction] += 1
        return result
