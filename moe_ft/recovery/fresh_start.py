"""A start that does not recover must find its job's node-local store empty.

A job resubmitted under the same ``--ft-job-id`` (restart count 0, no complete durable point, so
:func:`moe_ft.recovery.driver.should_recover` says no) finds the points of its previous run in
``<ft-store-dir>/<job>``: its first snapshot then collides with a published point of the old run
(``point 0 is already published``), or, later, it recovers from a mix of both runs. :func:`held_points` lists
what this node holds of the job (read only: nothing is opened for writing, nothing created) and
:func:`stale_store_error` says, in one line, what to do; the runtime stops every rank with it (exit 2) before
it writes anything (``FTRuntime.on_train_start``).
"""

from __future__ import annotations

import os

from moe_ft.elastic.inventory import store_dirs
from moe_ft.store import StoreError, open_backend


def held_points(store_dir: str, job_id: str) -> dict[str, list[int]]:
    """``{store directory (relative to the job's directory): published iterations}`` of job ``job_id`` on
    this node, for the snapshot stores, survivor points and replicas held for peers that hold any (a
    directory that is no store yet, without its ``FORMAT.json``, holds none)."""
    job_dir = os.path.join(store_dir, job_id)
    out = {}
    for d in store_dirs(store_dir, job_id):
        path = d.config.directory
        try:
            points = open_backend(path, create=False).list_points()
        except StoreError:
            continue
        if points:
            out[os.path.relpath(path, job_dir)] = points
    return out


def stale_store_error(job_dir: str, held: dict[str, list[int]], recover_mode: str) -> str:
    """The one line that stops a start which does not recover but finds ``held`` (not empty) in ``job_dir``."""
    newest = max(max(points) for points in held.values())
    names = ", ".join(sorted(held)[:3]) + (", ..." if len(held) > 3 else "")
    what = f"recovery points up to iteration {newest} in {len(held)} store director" + \
        f"{'y' if len(held) == 1 else 'ies'} ({names})"
    why = "--ft-recover never" if recover_mode == "never" else "no restart and no complete durable point"
    return (f"the node-local store {job_dir} already holds {what} of an earlier run of this --ft-job-id, and "
            f"this start does not recover from it ({why}): pass a new --ft-job-id, --ft-recover always to "
            f"resume from it, or delete {job_dir}")
