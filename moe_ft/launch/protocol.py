"""The store contract between ``moe-ft launch``'s agent and its workers.

All keys live in the rendezvous store the workers already reach (``MASTER_ADDR:MASTER_PORT`` with torch
elastic's agent store), under ``moe_ft/launch/<run id>/``:

``attempt``                 counter: the newest attempt. Every start of the worker group (the first, and
                            each full restart) and every in-process replacement is one attempt; workers
                            see it as ``TORCHELASTIC_RESTART_COUNT`` (process groups are keyed by it, and
                            recovery treats any attempt > 0 as a restart).
``attempt/<a>``             JSON written before the counter reaches ``a``: ``kind`` (``"job"`` or
                            ``"inprocess"``), ``failed`` (global ranks replaced), ``detected_at`` (wall time
                            the agent saw the death).
``spare/<slot>``            JSON assignment of a spare: ``rank``, ``local_rank``, ``attempt``.
``pid/<a>/<rank>``          the pid that holds ``rank`` in attempt ``a`` (written by the worker).

The environment carries the rest: ``MOE_FT_LAUNCH_RUN`` (the run id; set only under ``moe-ft launch``),
``MOE_FT_SPARE_SLOT`` (set only for a spare), ``MOE_FT_REFORM_TIMEOUT`` (seconds a survivor waits for the
next attempt before it gives up and exits, which makes the agent fall back to a full restart).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

RUN_ENV = "MOE_FT_LAUNCH_RUN"
SPARE_ENV = "MOE_FT_SPARE_SLOT"
REFORM_TIMEOUT_ENV = "MOE_FT_REFORM_TIMEOUT"
DEFAULT_REFORM_TIMEOUT_S = 60.0

GAVE_UP_EXIT_CODE = 75
"""A survivor that could not join a new attempt in time exits with this code (``EX_TEMPFAIL``): the agent
then stops replacing ranks one by one and restarts the whole group."""


def prefix(run_id: str) -> str:
    return f"moe_ft/launch/{run_id}/"


@dataclass(frozen=True)
class Keys:
    """Key names for one run."""

    run_id: str

    @property
    def attempt(self) -> str:
        return prefix(self.run_id) + "attempt"

    def announcement(self, attempt: int) -> str:
        return prefix(self.run_id) + f"attempt/{attempt}"

    def spare(self, slot: str) -> str:
        return prefix(self.run_id) + f"spare/{slot}"

    def pid(self, attempt: int, rank: int) -> str:
        return prefix(self.run_id) + f"pid/{attempt}/{rank}"


def current_attempt(store, keys: Keys) -> int:
    return int(store.add(keys.attempt, 0))


def announce(store, keys: Keys, *, kind: str, failed: list[int], detected_at: float,
             assignments: dict[str, dict] | None = None) -> int:
    """Agent: publish the next attempt (its announcement and spare assignments first, then the counter, so
    that a worker that sees the counter finds both). Returns the new attempt."""
    attempt = current_attempt(store, keys) + 1
    store.set(keys.announcement(attempt), json.dumps({"kind": kind, "failed": sorted(failed),
                                                      "detected_at": detected_at}))
    for slot, assignment in (assignments or {}).items():
        store.set(keys.spare(slot), json.dumps({**assignment, "attempt": attempt}))
    got = int(store.add(keys.attempt, 1))
    if got != attempt:
        raise RuntimeError(f"two agents announced attempt {attempt} at once (counter now {got}): "
                           "moe-ft launch replaces ranks in-process on one node only; use --max-restarts")
    return attempt


def announcement(store, keys: Keys, attempt: int) -> dict:
    """The announcement of ``attempt`` (``{}`` for an attempt the agent did not announce, e.g. the first)."""
    key = keys.announcement(attempt)
    return json.loads(store.get(key)) if store.check([key]) else {}


def wait_for_attempt_after(store, keys: Keys, attempt: int, timeout_s: float, poll_s: float = 0.02) -> int | None:
    """Worker: the first attempt newer than ``attempt``, or ``None`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = current_attempt(store, keys)
        if now > attempt:
            return now
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def wait_for_assignment(store, keys: Keys, slot: str, poll_s: float = 0.02) -> dict:
    """Spare: block until the agent assigns ``slot`` a rank (a spare never assigned is stopped by the agent)."""
    key = keys.spare(slot)
    while not store.check([key]):
        time.sleep(poll_s)
    return json.loads(store.get(key))


def reform_timeout_s() -> float:
    return float(os.environ.get(REFORM_TIMEOUT_ENV, DEFAULT_REFORM_TIMEOUT_S))
