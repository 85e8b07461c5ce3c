"""megatron-core's checkpoint writer without a multiprocessing *Manager* (SPEC §5: a killed rank must not
leave anything behind that blocks the restart).

``FileSystemWriterAsync`` (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``) collects the
write results of every save through ``_get_write_results_queue()``: a ``Manager().Queue()``, i.e. a
*spawned server process* per rank, started at the first save and stopped only by the rank's normal exit.
A rank killed with SIGKILL (a crash, an OOM kill, our failure drills) leaves that server running forever,
still holding the job's stdout/stderr: one leaked process per killed rank per failure, and a ``torchrun``
read through a pipe never sees EOF (found by ``tests/test_replication_recovery.py``, which hung).

The queue is written by the rank itself (synchronous save) or by a *fork* of it (megatron-core's
non-persistent async caller, which ``moe_ft/persist/megatron_dense.py`` uses), so a fork-context queue —
a pipe, no server — carries the same results. :func:`install` sets it before the first save; it refuses
other megatron-core versions (the global it sets is private), like ``moe_ft/compat/cpu.py``.
"""

from __future__ import annotations

import multiprocessing as mp

from moe_ft.compat.cpu import SUPPORTED_MCORE_VERSIONS


def install() -> None:
    """Idempotent; call before the first ``dist_checkpointing.save`` of the process."""
    from megatron.core import package_info
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if package_info.__version__ not in SUPPORTED_MCORE_VERSIONS:
        raise RuntimeError(f"moe_ft.compat.writer_queue was written for megatron-core "
                           f"{', '.join(SUPPORTED_MCORE_VERSIONS)}, found {package_info.__version__}: check "
                           "filesystem_async._get_write_results_queue before allowing it")
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = mp.get_context("fork").Queue()
