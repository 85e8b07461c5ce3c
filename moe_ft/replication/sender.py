"""Background sender: after the snapshot engine publishes point ``t`` in the node-local store, read its
entry files and send them to this rank's replica peers (``placement.py``), on a thread of its own.

``submit(t)`` only enqueues an iteration number, so the training step never waits for the network;
the point is pinned in the store while it is read. Points that garbage collection removed before the
sender got to them (replication slower than snapshots) are skipped and counted. ``lag(t)`` is the number
of iterations the newest replicated point is behind ``t`` (logged in the FT line).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from moe_ft.replication.transport import PointMessage, Transport
from moe_ft.store import SnapshotStore
from moe_ft.store.backend import MANIFEST
from moe_ft.store.manifest import EntryRecord, decode_manifest

logger = logging.getLogger("moe_ft.replication")


@dataclass(kw_only=True)
class SenderConfig:
    publish_timeout_s: float = 300.0
    """How long the sender waits for a submitted iteration to be published before skipping it."""
    poll_s: float = 0.002
    """Polling period while waiting for the publish (the engine publishes on its own thread)."""


@dataclass(frozen=True)
class SentRecord:
    iteration: int
    nbytes: int  # payload bytes, summed over peers
    num_entries: int
    seconds: float


class ReplicaSender:
    """Replicates this rank's published points to ``peers`` over ``transport``. ``select(entry)`` decides
    which operator entries are sent (``needs_replication``); the metadata entry always is."""

    def __init__(self, config: SenderConfig, store: SnapshotStore, transport: Transport, peers: Sequence[int], *,
                 owner: int, select: Callable[[EntryRecord], bool] | None = None) -> None:
        self.config, self.store, self.transport = config, store, transport
        self.peers, self.owner = tuple(peers), owner
        self.select = select or (lambda entry: True)
        self.sent: list[SentRecord] = []
        self.skipped: list[tuple[int, str]] = []
        self.submitted_iteration: int | None = None
        self.replicated_iteration: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"moe-ft-replica-send{owner}", daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------------------
    def submit(self, iteration: int) -> None:
        """Replicate point ``iteration`` once it is published (returns at once)."""
        self._raise_if_failed()
        self.submitted_iteration = iteration
        if self.peers:
            self._queue.put(iteration)

    def lag(self, iteration: int) -> int:
        """Iterations between ``iteration`` and the newest point fully sent to every peer."""
        done = self.replicated_iteration
        return iteration - done if done is not None else iteration + 1

    def flush(self) -> None:
        """Block until every submitted point is sent (tests, end of training)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Send what is queued, then tell the peers that this stream ends."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join()
        for peer in self.peers:
            self.transport.close_to(peer)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"replication of rank {self.owner} to {list(self.peers)} failed: "
                               f"{self._error!r}") from self._error

    # -- sender thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            iteration = self._queue.get()
            try:
                if iteration is None:
                    return
                if self._error is None:
                    self._replicate(iteration)
            except BaseException as exc:  # surfaced on the training thread by the next submit/flush
                self._error = exc
                logger.error("moe-ft replication rank %d: %r", self.owner, exc)
            finally:
                self._queue.task_done()

    def _wait_published(self, iteration: int) -> bool:
        deadline = time.monotonic() + self.config.publish_timeout_s
        while iteration not in self.store.points():
            if time.monotonic() > deadline:
                return False
            time.sleep(self.config.poll_s)
        return True

    def _skip(self, iteration: int, why: str) -> None:
        self.skipped.append((iteration, why))
        logger.warning("moe-ft replication rank %d: point %d not replicated: %s", self.owner, iteration, why)

    def _replicate(self, iteration: int) -> None:
        if not self._wait_published(iteration):
            return self._skip(iteration, f"not published within {self.config.publish_timeout_s:.0f} s")
        start = time.perf_counter()
        backend = self.store.backend
        try:
            with self.store.pin([iteration]):
                manifest = backend.read_blob(iteration, MANIFEST)
                record = decode_manifest(manifest, iteration, f"{backend.describe()} iteration {iteration}")
                chosen = [e for e in record.all_entries() if e.op is None or self.select(e)]
                blobs = {e.blob: backend.read_blob(iteration, e.blob) for e in chosen}
        except FileNotFoundError:
            return self._skip(iteration, "deleted by garbage collection before it was read "
                                         "(replication slower than snapshots)")
        message = PointMessage(owner=self.owner, iteration=iteration, manifest=manifest, blobs=blobs)
        nbytes = sum(self.transport.send_point(peer, message) for peer in self.peers)
        self.sent.append(SentRecord(iteration, nbytes, len(chosen), time.perf_counter() - start))
        self.replicated_iteration = iteration
