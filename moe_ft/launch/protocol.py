"""The store contract between ``moe-ft launch``'s agent and its workers.

All keys live in the rendezvous store the workers already reach (``MASTER_ADDR:MASTER_PORT`` with torch
elastic's agent store), under ``moe_ft/launch/<run id>/``:

``attempt``                 counter: the newest attempt. Every start of the worker group (the first, and
                            each full restart) and every in-process replacement is one attempt; workers
                            see it as ``TORCHELASTIC_RESTART_COUNT`` (process groups are keyed by it, and
                            recovery treats any attempt > 0 as a restart).
``decide/<a>``              the agent that decides attempt ``a`` (a lock taken with ``compare_set``: with
                            several nodes, two agents may see failures at once; one announces, the other
                            looks again once the announcement is out). An agent that announces nothing
                            after all (nothing left to decide, or its decision raised) deletes it.
``attempt/<a>``             JSON written before the counter reaches ``a``: ``kind`` (``"job"``: every worker
                            started again; ``"inprocess"``: failed ranks given to spares; ``"fallback"``: the
                            survivors must exit so that the agents restart everyone, for ``reason``;
                            ``"await"``: a lost node's ranks wait for a replacement node, the survivors
                            keep their processes and wait up to ``wait_s`` for the attempt that follows),
                            ``failed`` (global ranks replaced), ``detected_at`` (wall time the agent saw the
                            death), ``holders`` (rank → node that runs it), ``lost`` (nodes declared lost),
                            ``reason`` (fallbacks, and the full restart that follows one), ``resize``
                            (an in-process shrink: ``ranks`` old → new, ``world_size``, ``nodes`` → their
                            new group ranks), ``nodes`` (a replacement node joined after an ``"await"``:
                            each node of the new rendezvous round → the group rank its workers keep, the
                            replacement taking the lost node's), ``slots`` (an in-process replacement:
                            rank → the spare slot given it), ``spent_by`` (a fallback because the
                            workers could not go on in attempt ``spent_by``, which spent one of
                            ``--max-restarts`` for its failure: the agents give it back, so that one
                            failure spends one restart however it is recovered).
``spare/<slot>``            (slot ``r<round>.<node>.<n>``: unique across replacement agents) JSON
                            assignment of a spare: ``rank``, ``local_rank``, ``attempt``,
                            ``world_size``, ``group_rank`` (set with ``compare_set``: a spare is given once).
                            A claim stands once ``attempt/<a>`` names the slot (``slots``); the spare and
                            its node's agent act on it only then (a waiting spare waits in the store for
                            the next ``attempt/<a>`` and reads its key when it is set). An agent whose
                            decision fails after it claimed spares empties their keys again (``""``: not
                            given), before it frees the decision lock.
``spares/<node>``           JSON list of the node's waiting spares: ``[{"slot", "local_rank"}]`` (its agent
                            rewrites it when it changes; another node's agent may give them lost ranks).
``beat/<node>``             counter the node's agent bumps every monitor pass (its liveness).
``round/<r>``               the attempt of rendezvous round ``r`` (node 0's agent announces it, the others
                            read it): a full restart (kind ``"job"``), a node joined and the job grew
                            in-process (kind ``"inprocess"`` with ``resize`` and ``grown``: the new nodes),
                            or a replacement node took a lost node's ranks (``"inprocess"`` with ``nodes``).
``member/<r>/<node>``       JSON an agent posts once round ``r`` formed: its workers that stayed, old rank →
                            rank in the round's layout (``{}``: it starts every worker afresh; after an
                            ``"await"`` the survivors' ranks stay: old rank → old rank).
``regroup/<a>``             set by the agents when a node joins: the workers of attempt ``a`` leave it at
                            the end of an iteration they agree on, keep their processes (they hold their
                            state), wait for the round's attempt and take their ranks in it.
``suspect/<a>``             counter: workers of attempt ``a`` whose collectives failed because a peer died
                            (the agents then declare a silent node lost sooner).
``finished/<r>/<node>``     set by a node's agent once its workers all finished in rendezvous round ``r``
                            (``r<round>``; ``p<pid>`` without rounds), before it waits in the exit barrier
                            (which ends once every live node of the round is listed so) and leaves: the
                            other agents never watch it, declare it lost or claim its spares (it beats no
                            more once its wait runs out).
``standby/<a>/<rank>``      written by a worker of attempt ``a`` that the global batch leaves out (``--ft-elastic``:
                            the job trains on fewer ranks than it has) once its held state is in the node
                            store: JSON ``{"usable"}``; it then exits :data:`STANDBY_EXIT_CODE` and its agent
                            starts a spare on its device. The training ranks wait for these keys.
``surplus/<node>``          JSON list of the node's ranks whose workers stood by (no process runs them; an agent
                            deciding a shrink or a wait for a replacement node reads every node's).
``done``                    set by rank 0 once training ended: an agent left with spares only finishes then.
``pid/<a>/<rank>``          the pid that holds ``rank`` in attempt ``a`` (written by the worker).

The store is the rendezvous's own (the c10d backend's ``TCPStore``, at ``--rdzv-endpoint``): it outlives
every worker node, so the workers' process groups use it too (``MASTER_ADDR:MASTER_PORT`` point there).

The environment carries the rest: ``MOE_FT_LAUNCH_RUN`` (the run id; set only under ``moe-ft launch``),
``MOE_FT_SPARE_SLOT`` (set only for a spare), ``MOE_FT_REFORM_TIMEOUT`` (seconds a survivor waits for the
next attempt before it gives up and exits, which makes the agent fall back to a full restart),
``MOE_FT_LAUNCH_GROWS`` (nodes may join: the workers watch ``regroup/<a>``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

RUN_ENV = "MOE_FT_LAUNCH_RUN"
SPARE_ENV = "MOE_FT_SPARE_SLOT"
REFORM_TIMEOUT_ENV = "MOE_FT_REFORM_TIMEOUT"
GROWS_ENV = "MOE_FT_LAUNCH_GROWS"
"""Set when nodes may join (``--nnodes MIN:MAX``): the workers look for ``regroup/<a>``."""
DEFAULT_REFORM_TIMEOUT_S = 60.0
DEFAULT_NODE_TIMEOUT_S = 10.0
"""Seconds without a node agent's heartbeat before the other agents give its ranks to spares."""
SUSPECT_FACTOR = 5.0
MIN_SUSPECT_TIMEOUT_S = 1.0
"""Once a worker reported a dead peer in the current attempt, a silent node is declared lost after
``max(MIN_SUSPECT_TIMEOUT_S, --node-timeout / SUSPECT_FACTOR)`` (a declared node that was only slow fences
itself: its agent stops its workers, which never rejoin under a rank given away)."""
DEFAULT_STOP_TIMEOUT_S = 30.0
"""Seconds a worker or spare may stay stopped (SIGSTOP, SIGTSTP) before its agent kills it and replaces it
like a failed one (``--stop-timeout``)."""
SPARE_WAIT_S = 3600.0
"""The longest a waiting spare's wait in the store for the next announcement lasts before it looks again
(:func:`wait_for_assignment`; the store ends the wait the moment the announcement is set, so this bounds only a
wake-up that never came: each wait that runs out logs two c10d warning lines)."""
WATCH_POLL_S = 0.1
"""How often a worker looks for a newer attempt (``Membership.watch``)."""

GAVE_UP_EXIT_CODE = 75
"""A survivor that could not join a new attempt in time exits with this code (``EX_TEMPFAIL``): the agent
then stops replacing ranks one by one and restarts the whole group."""


STANDBY_EXIT_CODE = 76
"""A worker that the global batch leaves out (``--ft-elastic``: the world's data-parallel size does not divide
it, the job trains on fewer ranks) exits with this code: not a failure; its agent starts a spare in its place."""


USAGE_EXIT_CODE = 2
"""A worker's flags are wrong (the training script exits 2, as argparse does)."""
REFUSED_EXIT_CODE = 3
"""Recovery refused to go below ``--ft-min-recovery-level`` (every rank exits 3)."""
STOP_EXIT_CODES = (USAGE_EXIT_CODE, REFUSED_EXIT_CODE)
"""Exits on purpose, not process faults: a spare in its place would stop the same way, so the agent takes
torch elastic's path (stop every worker, restart while ``--max-restarts`` allows) instead of replacing it."""


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

    def decision(self, attempt: int) -> str:
        return prefix(self.run_id) + f"decide/{attempt}"

    def node_spares(self, node: int) -> str:
        return prefix(self.run_id) + f"spares/{node}"

    def beat(self, node: int) -> str:
        return prefix(self.run_id) + f"beat/{node}"

    def round(self, rdzv_round: int) -> str:
        return prefix(self.run_id) + f"round/{rdzv_round}"

    def member(self, rdzv_round: int, node: int) -> str:
        return prefix(self.run_id) + f"member/{rdzv_round}/{node}"

    def regroup(self, attempt: int) -> str:
        return prefix(self.run_id) + f"regroup/{attempt}"

    def suspect(self, attempt: int) -> str:
        return prefix(self.run_id) + f"suspect/{attempt}"

    def finished(self, rdzv_round: str, node: int) -> str:
        return prefix(self.run_id) + f"finished/{rdzv_round}/{node}"

    def pid(self, attempt: int, rank: int) -> str:
        return prefix(self.run_id) + f"pid/{attempt}/{rank}"

    def standby(self, attempt: int, rank: int) -> str:
        return prefix(self.run_id) + f"standby/{attempt}/{rank}"

    def surplus(self, node: int) -> str:
        return prefix(self.run_id) + f"surplus/{node}"

    @property
    def done(self) -> str:
        return prefix(self.run_id) + "done"


def current_attempt(store, keys: Keys) -> int:
    return int(store.add(keys.attempt, 0))


def lock_next(store, keys: Keys, by: str) -> int | None:
    """Agent: take the right to announce the next attempt; its number, or ``None`` when another agent
    holds it (look again once that attempt is announced: it may already cover this agent's failures)."""
    attempt = current_attempt(store, keys) + 1
    got = store.compare_set(keys.decision(attempt), "", by)
    return attempt if got in (by, by.encode()) else None


def release(store, keys: Keys, attempt: int) -> None:
    """Agent holding :func:`lock_next`'s ``attempt`` that announces nothing (nothing left to decide, or its
    decision failed on the way: fenced, a signal, a process that would not start): free the lock. A lock
    kept with the attempt unannounced would stop every agent from announcing it, and so any later
    in-process replacement, fallback and full restart of the job. Once ``attempt`` is announced the key is
    stale whatever it holds (:func:`lock_next` takes the attempt after the counter)."""
    store.delete_key(keys.decision(attempt))


def claim_spare(store, keys: Keys, slot: str, attempt: int, rank: int, local_rank: int, *,
                world_size: int | None = None, group_rank: int | None = None) -> str | None:
    """Give spare ``slot`` rank ``rank`` in ``attempt`` (and the job's current world size and the spare's
    node's group rank: both change when the job shrinks). Returns the assignment written (what
    :func:`release_spare` takes back), ``None`` when the spare was already given. The claim stands once
    ``attempt``'s announcement names the slot (:func:`claim_stands`)."""
    given = {"world_size": world_size, "group_rank": group_rank}
    value = json.dumps({"rank": rank, "local_rank": local_rank, "attempt": attempt,
                        **{k: v for k, v in given.items() if v is not None}})
    got = store.compare_set(keys.spare(slot), "", value)
    return value if got in (value, value.encode()) else None


def release_spare(store, keys: Keys, slot: str, claim: str) -> None:
    """Agent whose decision failed after :func:`claim_spare` returned ``claim`` (before it frees the decision
    lock, so before any agent can announce that attempt): the spare is free again. The key is emptied, not
    deleted: ``compare_set`` from ``""`` claims it again, and a reader never waits on a key that vanished
    between its check and its read."""
    store.compare_set(keys.spare(slot), claim, "")


def spare_assignment(store, keys: Keys, slot: str) -> dict | None:
    """The assignment claimed for spare ``slot``, ``None`` when it has none (never claimed, or released)."""
    key = keys.spare(slot)
    value = store.get(key) if store.check([key]) else b""
    return json.loads(value) if value else None


def claim_stands(store, keys: Keys, slot: str, assignment: dict) -> bool | None:
    """Whether ``assignment`` (of spare ``slot``) stands: ``True`` once its attempt's announcement gives the
    rank to this slot, ``False`` when the attempt was announced without it (the claiming decision failed and
    released it, or fell back), ``None`` while the attempt is not announced yet."""
    attempt = int(assignment["attempt"])
    if current_attempt(store, keys) < attempt:
        return None
    return announcement(store, keys, attempt).get("slots", {}).get(str(assignment["rank"])) == slot


def publish(store, keys: Keys, attempt: int, *, kind: str, failed: list[int], detected_at: float,
            **extra) -> int:
    """Agent holding :func:`lock_next`'s ``attempt``: write the announcement, then move the counter (a
    worker that sees the counter finds the announcement and its spares' assignments)."""
    store.set(keys.announcement(attempt), json.dumps({"kind": kind, "failed": sorted(failed),
                                                      "detected_at": detected_at, **extra}))
    got = int(store.add(keys.attempt, 1))
    if got != attempt:
        raise RuntimeError(f"attempt {attempt} published while the counter moved to {got}: an agent announced "
                           "without the decision lock (protocol.lock_next)")
    return attempt


def announce(store, keys: Keys, *, kind: str, failed: list[int], detected_at: float, by: str = "agent",
             **extra) -> int:
    """Lock and publish the next attempt, which nobody else may be deciding (node 0's full restart).
    Returns the attempt."""
    attempt = lock_next(store, keys, by)
    if attempt is None:
        raise RuntimeError(f"another agent holds the decision lock of attempt {current_attempt(store, keys) + 1}")
    return publish(store, keys, attempt, kind=kind, failed=failed, detected_at=detected_at, **extra)


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


def wait_for_assignment(store, keys: Keys, slot: str, wait_s: float = SPARE_WAIT_S) -> dict:
    """Spare: block until the agents give ``slot`` a rank and announce the attempt that names it (a spare never
    assigned is stopped by its agent). A claim whose decision failed is released and never acted on: the
    spare waits for the next one. ``store``: a client no other thread uses meanwhile (a wait in the store holds
    its connection; a spare's own, ``worker.join``).

    A claim stands only once an attempt newer than those announced so far names it, so between two looks the
    spare waits in the store for that attempt's announcement (``attempt/<newest + 1>``, set before the counter
    moves): the store answers the moment it is set. Before, the spare looked every 20 ms (50 requests a second
    per spare, 150 while a claim waited for its announcement); now three requests per announcement, and one
    wait per ``wait_s``, and it takes its rank sooner (no poll interval)."""
    from torch.distributed import DistStoreError  # start-up time: this module's constants are read without torch

    while True:
        newest = current_attempt(store, keys)  # read before the claim: an attempt announced after it wakes the wait
        assignment = spare_assignment(store, keys, slot)
        if assignment is not None and claim_stands(store, keys, slot, assignment):
            return assignment
        try:
            store.wait([keys.announcement(newest + 1)], timedelta(seconds=wait_s))
        except DistStoreError:  # no announcement within wait_s: look again (a lost store raises DistNetworkError)
            continue


def reform_timeout_s() -> float:
    return float(os.environ.get(REFORM_TIMEOUT_ENV, DEFAULT_REFORM_TIMEOUT_S))
