"""megatron-core's checkpoint writer without a multiprocessing *Manager* (a killed rank must not leave
anything behind that blocks the restart).

``FileSystemWriterAsync`` (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``) collects the
write results of every save through ``_get_write_results_queue()``: a ``Manager().Queue()``, i.e. a
*spawned server process* per rank, started at the first save and stopped only by the rank's normal exit.
A rank killed with SIGKILL (a crash, an OOM kill, our failure drills) leaves that server running forever,
still holding the job's stdout/stderr: one leaked process per killed rank per failure, and a ``torchrun``
read through a pipe never sees EOF (found by ``tests/test_replication_recovery.py``, which hung).

The queue is written by the rank itself (synchronous save) or by a *fork* of it (megatron-core's
non-persistent async caller, which ``moe_ft/persist/megatron_dense.py`` uses), so a fork-context queue —
a pipe, no server — carries the same results (:class:`ResultsQueue`, whose ``get_nowait`` waits for results
still in its feeder thread). :func:`install` sets it before the first save; it refuses
other megatron-core versions (the global it sets is private), like ``moe_ft/compat/cpu.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.queues

from megatron.core import package_info
from megatron.core.dist_checkpointing.strategies import filesystem_async

from moe_ft.compat.cpu import SUPPORTED_MCORE_VERSIONS


class ResultsQueue(multiprocessing.queues.Queue):
    """A fork-context queue whose ``get_nowait`` waits for results already put to arrive.

    megatron-core reads the results with ``get_nowait()`` right after the writer ``put`` them. A Manager
    queue's ``put`` is a synchronous round trip; a pipe queue's ``put`` hands the object to a feeder thread,
    so an immediate ``get_nowait()`` in the same process can find the pipe still empty ("results_queue
    should not be empty", seen under load). The writer has always finished its ``put`` when megatron-core
    asks (synchronously, or the forked writer has exited, which flushes its feeder), so waiting for the
    bytes in transit is what ``get_nowait`` means here; a queue that is truly empty still raises
    ``queue.Empty`` after ``timeout_s``."""

    timeout_s = 60.0

    def __init__(self) -> None:
        super().__init__(ctx=mp.get_context("fork"))

    def get_nowait(self):
        return self.get(timeout=self.timeout_s)


def install() -> None:
    """Idempotent; call before the first ``dist_checkpointing.save`` of the process."""

    if package_info.__version__ not in SUPPORTED_MCORE_VERSIONS:
        raise RuntimeError(f"moe_ft.compat.writer_queue was written for megatron-core "
                           f"{', '.join(SUPPORTED_MCORE_VERSIONS)}, found {package_info.__version__}: check "
                           "filesystem_async._get_write_results_queue before allowing it")
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = ResultsQueue()
