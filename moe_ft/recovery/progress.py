"""Progress records: the newest iteration each rank completed, kept where a failure does not erase it
(the node-local job directory; rank 0 also next to the durable tier, which outlives every node). Recovery
reads them back to report how many iterations a failure cost."""

from __future__ import annotations

import os
from pathlib import Path

from moe_ft import comm


def progress_path(store_root: str, job_id: str, rank: int) -> Path:
    return Path(store_root) / job_id / f"progress_rank{rank}"


def write_progress(path: Path, iteration: int) -> None:
    """Record that ``iteration`` completed (atomically: a reader sees the old or the new number)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(iteration))
    os.replace(tmp, path)


def last_completed(store_root: str, job_id: str, rank: int, durable_dir: Path | None = None) -> int:
    """The newest iteration any rank completed before the failure (collective MAX; -1 if none): from the
    node-local progress files and, when every node was lost with them, from the one rank 0 keeps next to
    the durable tier (``durable_dir``)."""
    paths = [progress_path(store_root, job_id, rank)] + ([durable_dir / "progress"] if durable_dir else [])
    mine = max((int(p.read_text()) for p in paths if p.exists()), default=-1)
    return comm.max_over_ranks(mine)
