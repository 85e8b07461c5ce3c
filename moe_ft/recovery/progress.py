"""Progress records: the newest iteration each rank completed, kept where a failure does not erase it
(the node-local job directory; rank 0 also next to the durable tier, which outlives every node). Recovery
reads them back to report how many iterations a failure cost. Imports no torch at module level: the
``moe-ft`` console script's drill reports read the records too (``moe_ft/drills/report.py``)."""

from __future__ import annotations

import os
from pathlib import Path

RECORD = b"%020d\n"
"""A node-local record: one fixed-width line, rewritten in place (``ProgressFile``)."""


def progress_path(store_root: str, job_id: str, rank: int) -> Path:
    return Path(store_root) / job_id / f"progress_rank{rank}"


def write_progress(path: Path, iteration: int) -> None:
    """Record that ``iteration`` completed (atomically: a reader sees the old or the new number). For a
    record on shared storage (the durable tier's): a new file renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(iteration))
    os.replace(tmp, path)


class ProgressFile:
    """A node-local progress record written every iteration on the training thread: the file is opened
    once and each iteration rewrites its one fixed-width line in place (one ``pwrite(2)``, where
    :func:`write_progress` makes a directory check, a file and a rename: ~10 system calls, each one a
    point where a training thread gives up the GIL to the snapshot threads). A write of one line into one
    page is never half done by a killed process; a reader that runs while the line is rewritten reads
    until two reads agree (:func:`read_progress`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def write(self, iteration: int) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.pwrite(fd, RECORD % iteration, 0)
                os.ftruncate(fd, len(RECORD % 0))  # a longer record of an older format would leave a tail
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        os.pwrite(self._fd, RECORD % iteration, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_progress(path: Path) -> int | None:
    """The iteration ``path`` records (``None``: no record). Either format: a fixed-width line rewritten
    in place (read until two reads agree) or a number in a renamed file."""
    last = None
    for _ in range(100):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        if text == last:
            break
        last = text
    if not last or not last.strip():
        return None
    try:
        return int(last)
    except ValueError:
        raise ValueError(f"progress record {path} holds {last[:40]!r}, not an iteration number; remove the file "
                         "(recovery then reports the iterations lost from the other records)") from None


def last_completed(store_root: str, job_id: str, rank: int, durable_dir: Path | None = None) -> int:
    """The newest iteration any rank completed before the failure (collective MAX; -1 if none): from the
    node-local progress files and, when every node was lost with them, from the one rank 0 keeps next to
    the durable tier (``durable_dir``)."""
    from moe_ft import comm  # start-up time: imports torch (the records' readers in moe-ft's commands need none)

    paths = [progress_path(store_root, job_id, rank)] + ([durable_dir / "progress"] if durable_dir else [])
    records = [read_progress(p) for p in paths]
    mine = max((r for r in records if r is not None), default=-1)
    return comm.max_over_ranks(mine)
