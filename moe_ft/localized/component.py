"""The runtime component of upstream logging (MoEvement §3.4): installs the p2p and collective seams when the
job has pipeline parallelism and localized recovery, logs every trained iteration into the rank's
node-local log directory, and drops the iterations no retained recovery point needs any more.

Retention: a localized replay of the failed stage starts at the first iteration of the recovery point it
restores and runs to the last completed iteration, so the log must hold every iteration from the oldest
point the snapshot store still keeps. The store's own retention (``KeepTwoRecoverable``) deletes a point
once a newer recovery point is complete; after each snapshot the log drops what lies before the oldest
point left (:func:`oldest_needed`).
"""

from __future__ import annotations

from pathlib import Path

from moe_ft.localized.collective_log import CollectiveSeam
from moe_ft.localized.log_replay import LogSeams
from moe_ft.localized.log_store import LogDir
from moe_ft.localized.upstream_log import LogRecorder, P2PSeam
from moe_ft.runtime.components import Component


def upstream_root(job_dir: str | Path) -> Path:
    """``<store_dir>/<job>/upstream``: every rank's log directory on this node (:func:`log_root`)."""
    return Path(job_dir) / "upstream"


def log_root(job_dir: str | Path, rank: int) -> Path:
    """``<store_dir>/<job>/upstream/rank<r>``: beside the snapshot store, on the same tmpfs."""
    return upstream_root(job_dir) / f"rank{rank}"


def oldest_needed(store) -> int | None:
    """The first iteration of the oldest recovery point ``store`` still keeps (``None``: none yet, keep all)."""
    points = store.points()
    return min(points) if points else None


class UpstreamLogging(Component):
    """Logs sends and stage-spanning collective results of every trained iteration (``docs/localized.md``)."""

    def __init__(self, log_dir: LogDir, seams: LogSeams, *, owns_p2p_seam: bool = True) -> None:
        self.log_dir, self.seams, self.owns_p2p_seam = log_dir, seams, owns_p2p_seam
        self.recorder = LogRecorder(log_dir, background=True)  # no device sync, no write on the training thread
        seams.p2p.recorder = seams.collectives.recorder = self.recorder
        self.dropped: list[int] = []

    @staticmethod
    def wanted(args, config) -> bool:
        """Pipeline parallelism, snapshots on, and localized recovery (``--ft-recovery-scope localized``)."""
        return (args.parallel.pipeline_model_parallel_size > 1 and config.snapshot.enabled
                and getattr(config.recovery, "recovery_scope", "localized") == "localized")

    @classmethod
    def build(cls, job_dir: str | Path, rank: int) -> "UpstreamLogging":
        """Collective (every rank at the same point: the stage map is gathered on the host path)."""
        shared = P2PSeam.current()  # bubble-aware snapshots may have installed it already
        seams = LogSeams(p2p=shared or P2PSeam().install(), collectives=CollectiveSeam.gather_stages().install())
        return cls(LogDir(log_root(job_dir, rank)), seams, owns_p2p_seam=shared is None)

    def on_step_begin(self, iteration: int) -> None:
        self.recorder.begin(iteration)

    def on_iteration_end(self, iteration: int, replaying: bool) -> None:
        self.recorder.end()

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        if session is None:
            return
        oldest = oldest_needed(session.store)
        if oldest is not None:  # behind the writes queued so far (one thread changes the log directory)
            self.recorder.run_after(lambda: self.dropped.extend(self.log_dir.drop_before(oldest)))

    def drain(self) -> None:
        self.recorder.flush()

    def stored_bytes_per_iteration(self) -> int:
        """What the newest logged iteration occupies in the log directory (0: nothing logged yet)."""
        self.drain()
        logged = self.log_dir.iterations()
        return self.log_dir.nbytes(logged[-1]) if logged else 0

    def after_recovery(self, report, session) -> None:
        self.recorder.flush()
        self.log_dir.drop_after(report.timeline_kept_through)  # the abandoned timeline

    def metrics(self, record) -> dict:
        logged = self.recorder.bytes_per_iteration
        return {"upstream_log_bytes": logged[max(logged)]} if logged else {}

    def close(self) -> None:
        self.seams.p2p.recorder = self.seams.collectives.recorder = None
        self.recorder.close()
        if self.owns_p2p_seam:
            self.seams.p2p.uninstall()
        self.seams.collectives.uninstall()
