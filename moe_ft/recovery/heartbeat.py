"""Waiting on a replay's progress instead of on one collective (localized recovery).

During a localized recovery (MoEvement §3.4) the loading ranks are done in milliseconds while the failed
stage replays its window, which may take minutes on a large model. Waiting for it inside one collective
bounds the whole replay by the group's timeout (``--distributed-timeout-minutes``): a longer replay timed
out on every loader, the job restarted, chose the same scope and timed out again until ``--max-restarts``.

Here the replaying ranks bump a counter in the default group's store for every replayed iteration and mark
themselves done (whatever the outcome: the outcome itself is agreed in the collective that follows); the
loading ranks poll that store and give up only when the counter stood still for the timeout. The
collective after it then waits for nobody. A replaying rank also beats a liveness counter from a thread
(every :data:`ALIVE_EVERY_S`): a dead one is noticed after :data:`DEAD_AFTER_S`, as fast as the failed
collective it replaces would have noticed it, however long the replay's steps are.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

ALIVE_EVERY_S = 0.5
DEAD_AFTER_S = 10.0


class ReplayStalled(RuntimeError):
    """The replaying ranks made no progress for the allowed time (a hung or dead replayer)."""


@dataclass
class ReplayProgress:
    """The progress keys of one localized recovery (unique per attempt: the default group's store is keyed
    by run and attempt; per target iteration within it)."""

    store: dist.Store
    prefix: str
    replaying: list[int]
    stall_s: float
    """Seconds without progress after which the waiting ranks give up (``--distributed-timeout-minutes``)."""
    dead_s: float = DEAD_AFTER_S
    """Seconds without a liveness beat after which the waiting ranks give up (a replayer died)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def for_recovery(cls, target: int, replaying: list[int], stall_s: float) -> "ReplayProgress":
        store = dist.distributed_c10d._get_default_store()
        return cls(store, f"moe_ft/localized/replay/T{target}/", list(replaying), stall_s)

    def beat(self) -> None:
        """A replaying rank finished one more step of its replay."""
        self.store.add(self.prefix + "progress", 1)

    def start_alive(self) -> None:
        """A replaying rank: beat the liveness counter from a daemon thread until :meth:`done`."""
        def run() -> None:
            while not self._stop.wait(ALIVE_EVERY_S):
                try:
                    self.store.add(self.prefix + "alive", 1)
                except Exception:  # noqa: BLE001 - the store is gone: the waiting ranks see it too
                    return

        self._thread = threading.Thread(target=run, name="moe-ft-replay-alive", daemon=True)
        self._thread.start()

    def stop_alive(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def done(self) -> None:
        """A replaying rank ended its replay (succeeded or not)."""
        self.stop_alive()
        self.store.add(self.prefix + "done", 1)

    def wait(self, poll_s: float = 0.05) -> float:
        """A loading rank: block until every replaying rank is done; returns the seconds waited. Raises
        :class:`ReplayStalled` once the progress counter stood still for :attr:`stall_s`."""
        t0 = last_change = last_alive = time.monotonic()
        seen = alive = -1
        while int(self.store.add(self.prefix + "done", 0)) < len(self.replaying):
            now = time.monotonic()
            progress = int(self.store.add(self.prefix + "progress", 0))
            beats = int(self.store.add(self.prefix + "alive", 0))
            if progress != seen:
                seen, last_change = progress, now
            elif now - last_change > self.stall_s:
                raise ReplayStalled(f"the replaying ranks {self.replaying} made no progress for {self.stall_s:.0f} s "
                                    f"(after {seen} replayed steps; --distributed-timeout-minutes)")
            if beats != alive:
                alive, last_alive = beats, now
            elif now - last_alive > self.dead_s:
                raise ReplayStalled(f"the replaying ranks {self.replaying} stopped beating for {self.dead_s:.0f} s "
                                    "(a replaying process died)")
            time.sleep(poll_s)
        return time.monotonic() - t0
