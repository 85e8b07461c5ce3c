"""Deterministic failure injection for drills and tests, keyed by ``(rank, iteration, phase)``.

A :class:`FaultPlan` holds :class:`Fault` events (torchft ``EventInjector().fail_at(rank, step)``, NVRx
``Fault`` kinds). The runtime calls :meth:`FaultPlan.check` at fixed points of an iteration; a fault
whose key matches fires **once across restarts**: before firing it creates a marker file
(``O_CREAT | O_EXCL``) in ``marker_dir``, which outlives the process (put it next to the node-local
store), so the restarted worker passes the same point untouched.

Phases (where :class:`moe_ft.runtime.FTRuntime` calls ``check``):

=============  ================================================================================
``forward``    start of the iteration, before the first micro-batch's forward
``backward``   forward/backward done, right before the optimizer step
``step``       optimizer step done, before the snapshot of the iteration is taken
``snapshot``   the snapshot's copy has just been handed to the engine's thread (copy in flight)
``publish``    the store is about to rename the iteration's staging directory into place
``published``  the store has just renamed the iteration's point into place (only kind ``corrupt``)
``persist``    the iteration ends with a ``--save`` checkpoint: fires during its write (the shards are on
               disk, the checkpoint is not finalized: ``StepHooks.during_checkpoint_write``); with
               ``--ft-persist-interval`` equal to ``--save-interval`` the durable writer is flushing
               the same iteration in the background then
``recovery``   a recovery is replaying or re-executing the iteration (cascading failure)
``survivor``   a stopped rank is writing its survivor point of the iteration (after half of its operators;
               ``moe_ft/localized/survivor.py``): a survivor that dies during its dump is a failed rank
``fallback``   the recovery from a failure at the iteration found the localized replay impossible and
               its global path has just rewritten the live state (``moe_ft/recovery/driver.py``)
=============  ================================================================================

Kinds: ``exit`` (SIGKILL of the process itself: no cleanup, like a crashed worker), ``exception`` (an
:class:`InjectedFault` raised on the training thread), ``hang`` (the thread blocks forever; the
:class:`moe_ft.recovery.watchdog.Watchdog` detects it by timeout and kills the process), ``corrupt`` (phase ``published`` only: flip one byte of the
point's first data file, as a torn or bit-rotted store entry, then SIGKILL so that the job recovers and must
detect it), ``node`` (the whole simulated node is lost at once: SIGKILL of this worker's torchrun agent, of
every process the agent started — the other ranks of the node — and of this process; see
:func:`kill_node`. ``moe-ft drill --nodes N --fail-node NODE:ITER[:PHASE]`` schedules it on the node's first
rank, then deletes the node's store and starts a replacement, ``moe_ft/drills/cluster.py``), ``corrupt-log``
(flip one byte of the newest upstream-log entry another rank wrote for this one -- what this rank's stage
will replay from, ``docs/localized.md`` -- then SIGKILL: the localized replay must detect it and fall back
to the global path), ``slow`` (the rank sleeps :data:`SLOW_FAULT_S` seconds, then goes on: a slow step, e.g.
several of them in a replay that must outlast a short ``--distributed-timeout-minutes``), ``stop`` (SIGSTOP of
the process itself: every thread stops, its watchdog included; under ``moe-ft launch`` the agent kills it after
``--stop-timeout`` and replaces it; a SIGCONT before that lets it go on).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import psutil

if TYPE_CHECKING:
    from moe_ft.store.backend import StoreBackend

PHASES = ("forward", "backward", "step", "snapshot", "publish", "published", "persist", "recovery", "survivor",
          "fallback")
KINDS = ("exit", "exception", "hang", "corrupt", "node", "corrupt-log", "slow", "stop")
SLOW_FAULT_S = 3.0
"""How long a ``slow`` fault stalls its rank (then it goes on)."""


class InjectedFault(RuntimeError):
    """Raised by a fault of kind ``exception``."""


@dataclass(frozen=True, order=True)
class Fault:
    """One scheduled failure: ``rank`` fails at ``phase`` of ``iteration`` (0-based) with ``kind``."""

    rank: int
    iteration: int
    phase: str = "forward"
    kind: str = "exit"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"fault phase must be one of {PHASES}, got {self.phase!r}")
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "corrupt") != (self.phase == "published"):
            raise ValueError(f"fault {self}: kind 'corrupt' goes with phase 'published' and only with it "
                             "(e.g. 2:8:published:corrupt)")
        if self.rank < 0 or self.iteration < 0:
            raise ValueError(f"fault rank and iteration must be >= 0, got {self.rank}:{self.iteration}")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """``RANK:ITER[:PHASE[:KIND]]``, e.g. ``1:6``, ``2:5:snapshot``, ``0:7:forward:hang``."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"bad fault {text!r}: expected RANK:ITER[:PHASE[:KIND]], e.g. 1:6:forward")
        try:
            rank, iteration = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"bad fault {text!r}: RANK and ITER must be integers") from None
        return cls(rank, iteration, *(parts[2:]))

    def __str__(self) -> str:
        return f"{self.rank}:{self.iteration}:{self.phase}:{self.kind}"

    @property
    def marker_name(self) -> str:
        return f"fault_r{self.rank}_i{self.iteration}_{self.phase}_{self.kind}.fired"


@dataclass(kw_only=True)
class FaultPlanConfig:
    """What to inject and where to remember that it fired."""

    faults: list[str] = field(default_factory=list)
    """Faults as ``RANK:ITER[:PHASE[:KIND]]`` (see :meth:`Fault.parse`)."""
    marker_dir: str = ""
    """Directory for the fired-markers (must survive restarts; empty: faults are off)."""


class FaultPlan:
    """The faults of one job. ``check(rank, iteration, phase)`` fires a matching, not yet fired fault."""

    def __init__(self, faults: Iterable[Fault], marker_dir: str | os.PathLike | None) -> None:
        self.faults = tuple(sorted(faults))
        self.marker_dir = Path(marker_dir) if marker_dir else None
        if self.faults and self.marker_dir is None:
            raise ValueError("a fault plan needs a marker directory so that each fault fires only once")
        self._index = {(f.rank, f.iteration, f.phase): f for f in self.faults}

    @classmethod
    def from_config(cls, config: FaultPlanConfig) -> "FaultPlan":
        return cls([Fault.parse(s) for s in config.faults], config.marker_dir or None)

    @classmethod
    def seeded(cls, seed: int, *, num_ranks: int, iterations: range, count: int, marker_dir,
               phases: Iterable[str] = ("forward", "backward", "step", "snapshot", "publish"),
               kind: str = "exit") -> "FaultPlan":
        """``count`` faults drawn from ``random.Random(seed)`` over ranks x iterations x phases, at
        distinct iterations: the same seed gives the same plan."""
        rng = random.Random(seed)
        its = rng.sample(list(iterations), count)
        phase_list = list(phases)
        return cls([Fault(rng.randrange(num_ranks), it, rng.choice(phase_list), kind) for it in sorted(its)],
                   marker_dir)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def fired(self) -> list[Fault]:
        """The faults whose marker exists (fired in this or an earlier incarnation of the job)."""
        return [f for f in self.faults if self.marker_dir is not None and (self.marker_dir / f.marker_name).exists()]

    def check(self, rank: int, iteration: int, phase: str, target: Any = None) -> None:
        """Fire the fault at ``(rank, iteration, phase)`` if there is one and it has not fired yet.
        ``target``: the published point, (store backend, iteration) (phase ``published``: what ``corrupt`` damages), or the
        job's upstream-log root (what ``corrupt-log`` damages)."""
        fault = self._index.get((rank, iteration, phase))
        if fault is None or (fault.kind == "node" and not _on_launch_node(rank)) or not self._claim(fault):
            return
        print(f"moe-ft fault injection: rank {rank} fails at iteration {iteration} ({phase}, {fault.kind})",
              file=sys.stderr, flush=True)
        if fault.kind in ("corrupt", "corrupt-log"):
            damaged = corrupt_point(target) if fault.kind == "corrupt" else corrupt_upstream_log(target, rank)
            print(f"moe-ft fault injection: corrupted {damaged}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "slow":
            time.sleep(SLOW_FAULT_S)
            return
        if fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if fault.kind == "node":
            kill_node()
        if fault.kind == "exception":
            raise InjectedFault(f"injected fault {fault} (rank {rank}, iteration {iteration}, phase {phase})")
        threading.Event().wait()  # hang: only the watchdog's timeout ends this process

    def _claim(self, fault: Fault) -> bool:
        """Create the marker atomically; False if it already existed (fired before a restart)."""
        assert self.marker_dir is not None
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / fault.marker_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{fault}\npid {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        return True


def _on_launch_node(rank: int) -> bool:
    """Whether ``rank`` runs on the node its launch placed it on (a ``node`` fault names a node by its first
    rank: a spare elsewhere that took that rank after the node was lost is not that node)."""
    node, per_node = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    return node is None or per_node is None or rank // int(per_node) == int(node)


AGENT_PID_ENV = "MOE_FT_AGENT_PID"
"""Set by a launcher whose workers are not its children (forked from a fork server it started): its pid."""


def agent_process() -> psutil.Process:
    """This torchrun worker's agent: the ancestor named by :data:`AGENT_PID_ENV` (workers forked from a fork
    server), else the parent."""
    named = os.environ.get(AGENT_PID_ENV)
    if named:
        for ancestor in psutil.Process().parents():
            if ancestor.pid == int(named):
                return ancestor
    return psutil.Process(os.getppid())


def resource_tracker(process: psutil.Process) -> bool:
    """Whether ``process`` is a ``multiprocessing`` resource tracker. A simulated node loss spares it: once
    the processes it served are gone it removes their named semaphores from ``/dev/shm`` and exits, as a
    lost node's tmpfs would go with it (killed, it would leave them on the machine that simulates the nodes)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return any("multiprocessing.resource_tracker" in part for part in process.cmdline())
    return False


def kill_node() -> None:
    """SIGKILL the node this torchrun worker runs on: its agent first (:func:`agent_process`), so that it
    cannot restart anything, then every other process below the agent (torchrun puts each worker in a
    session of its own, so a process-group kill would miss them) but a :func:`resource_tracker`, then this
    process. Never returns.

    Outside torchrun (no ``TORCHELASTIC_RUN_ID``) the parent is not an agent: only this process is killed."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        me = os.getpid()
        try:
            agent = agent_process()
            victims = [p for p in agent.children(recursive=True)  # listed before the agent dies
                       if p.pid != me and not resource_tracker(p)]
            agent.kill()
        except psutil.NoSuchProcess:
            victims = []
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):  # already gone
                p.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt_upstream_log(upstream_root: str | os.PathLike | None, rank: int) -> str:
    """Flip one byte in the middle of the newest log entry another rank sent to ``rank`` (entry
    ``send.<dir>.to<rank>`` of ``<root>/rank<r>``'s newest iteration holding one), in place; returns what was
    damaged."""
    # start-up time: `moe-ft --help` imports the drills and must not import torch (the log store does)
    from moe_ft.localized.log_store import LogDir

    if upstream_root is None:
        raise ValueError("a 'corrupt-log' fault needs upstream logging (pipeline parallelism, localized scope)")
    found = []
    for rank_dir in sorted(Path(upstream_root).glob("rank*")):
        if rank_dir.name == f"rank{rank}":
            continue
        log = LogDir(rank_dir)
        for it in log.iterations():
            found += [(it, str(rank_dir), name, log) for name in log.entry_names(it)
                      if name.startswith("send.") and name.endswith(f".to{rank}")]
    if not found:
        raise RuntimeError(f"no upstream-log entry for rank {rank} under {upstream_root}")
    it, where, name, log = max(found, key=lambda f: (f[0], f[1], f[2]))
    flip_middle_byte(*log.location(it, name))
    return f"{where} iteration {it} {name}"


def flip_middle_byte(path: str | os.PathLike, offset: int = 0, nbytes: int | None = None) -> Path:
    """Flip the middle byte of ``nbytes`` bytes at ``offset`` of file ``path`` (default: the whole file)."""
    path = Path(path)
    with open(path, "r+b") as f:
        f.seek(offset + (path.stat().st_size - offset if nbytes is None else nbytes) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    return path


def corrupt_point(point: "tuple[StoreBackend, int] | None") -> str:
    """Flip one byte in the middle of a published point's first FULL entry (by name), in place, whatever
    the store's layout; ``point``: (the store's backend, iteration). Returns what was damaged."""
    if point is None:
        raise ValueError("a 'corrupt' fault needs the published point: (store backend, iteration)")
    backend, iteration = point
    names = sorted((not n.endswith(".full.ent"), n) for n in backend.blob_names(iteration)
                   if n != "MANIFEST.json" and backend.blob_size(iteration, n))
    if not names:
        raise RuntimeError(f"nothing to corrupt in point {iteration} of {backend.describe()}")
    name = names[0][1]  # an operator's FULL entry first (what a recovery point needs)
    path, offset, nbytes = backend.blob_location(iteration, name)
    flip_middle_byte(path, offset, nbytes)
    return f"{backend.describe()} iteration {iteration} {name}"
