"""Hang detection by timeout: a rank whose training thread makes no progress for ``timeout_s`` kills
itself (SIGKILL), which torchrun's agent sees as a worker failure and answers with a restart."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class Watchdog:
    """``beat(iteration)`` from the training thread; a daemon thread checks the age of the last beat."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 s, got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self._last = time.monotonic()
        self._iteration = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe-ft-watchdog", daemon=True)
        self._thread.start()

    def beat(self, iteration: int) -> None:
        self._last, self._iteration = time.monotonic(), iteration

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"moe-ft watchdog: rank {self.rank} made no progress for {idle:.1f} s after iteration "
                      f"{self._iteration} (timeout {self.timeout_s} s): hang detected, exiting so that torchrun "
                      "restarts the job", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
