"""Will the snapshot store fit? Checked once at start, against the file system that holds it.

A node-local store lives on a tmpfs (``/dev/shm`` by default), often small: a container's default
``/dev/shm`` is 64 MB. Without a check, the first snapshot that does not fit ended the run with an
``ENOSPC`` traceback. The lower bound computed here is what the retention rule keeps at the least:

* snapshots: the two newest recoverable points plus the one being written, ``K`` per rank, the bytes of the
  snapshots the policy plans for them (``SnapshotPolicy.retained_plans``). A dense recovery point holds every
  operator of the rank at FULL once (``F``: the rank's operators at FULL): ``K = 3 x F``; a sparse window
  spreads them over its iterations and adds COMPUTE entries before each operator's FULL one (MoEvement
  §3.2): two whole windows and the one being written; the points of ``pec`` and ``selective`` overlap (each
  expert's newest FULL entry, MoC-System §3.2, MoEtion §4.3): one cycle of their expert selection and two
  snapshots more;
* a survivor point (localized scope): ``F``;
* replicas held for peers (``--ft-replicas r``): the same ``K`` for each peer whose points it holds;
* the upstream log (pipeline parallelism, localized scope): every iteration from the oldest point kept, at
  least a window plus one iteration (``L x (W + 1)``, ``L`` the stored bytes of the first logged iteration;
  known once it is logged, so a recovery's start, which checks before any iteration, counts none).

Every rank whose store is on the same file system (same ``st_dev``) counts. When the sum exceeds what the
file system has for this job (its free space plus what this job's stores already use there), the job
stops with one line naming the sizes and the fixes. A store that fills up later anyway (another process)
pauses the snapshots instead (``moe_ft/snapshot/engine.py``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

SNAPSHOT_POINTS = 3
"""Points at FULL kept at the least: two recoverable ones and the one being written."""


@dataclass(frozen=True)
class RankNeed:
    device: int
    """``st_dev`` of the file system holding the rank's store."""
    mount: str
    need_bytes: int


def rank_need(full_bytes: int, *, localized: bool, replicas: int, log_bytes: int = 0, window: int = 1,
              kept_bytes: int | None = None) -> int:
    """The least a rank's stores occupy (see the module docstring): ``kept_bytes`` of snapshots the
    retention keeps (``None``: :data:`SNAPSHOT_POINTS` dense points of ``full_bytes``), ``log_bytes`` per
    logged iteration, ``window`` iterations per recovery point."""
    kept = full_bytes * SNAPSHOT_POINTS if kept_bytes is None else kept_bytes
    return kept * (1 + replicas) + (full_bytes if localized else 0) + log_bytes * (window + 1)


def existing_dir(path: str | Path) -> Path:
    """``path``, or its nearest existing parent (the store directory may not exist yet)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return path


def mount_point(path: Path) -> str:
    path = existing_dir(path.resolve())
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def used_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (this job's stores already on the file system)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def shortfall(needs: list[RankNeed], store_dir: str, job_dir: str) -> str | None:
    """The one-line error when the ranks on this rank's file system need more than it has, else ``None``."""
    here = os.stat(existing_dir(Path(store_dir))).st_dev
    mine = [n for n in needs if n.device == here]
    need = sum(n.need_bytes for n in mine)
    usage = shutil.disk_usage(existing_dir(Path(store_dir)))
    has = usage.free + (used_bytes(Path(job_dir)) if Path(job_dir).exists() else 0)
    if need <= has:
        return None
    mount = mine[0].mount if mine else mount_point(Path(store_dir))
    return (f"the snapshot store needs at least {need / 2**20:.1f} MiB on {mount} ({len(mine)} rank(s) store "
            f"there: two recoverable points, the one being written, survivor points and replicas) but it has "
            f"{has / 2**20:.1f} MiB of {usage.total / 2**20:.1f} MiB: give it more (docker run --shm-size, or a "
            f"larger tmpfs), put --ft-store-dir on a file system with room, or keep less (--ft-replicas, "
            f"--ft-recovery-scope global)")
