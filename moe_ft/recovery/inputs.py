"""What one recovery acts on (:class:`RecoveryInputs`) and the small answers every recovery step asks of it: where
the durable tier and the audit log are, when the last drill fault fired, the report's phase seconds.

The runtime builds the inputs (``moe_ft/runtime/hooks.py``); the steps are in ``driver.py`` and
``localized_attempt.py``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from moe_ft.localized.component import UpstreamLogging
from moe_ft.persist import DurableTier
from moe_ft.persist.component import Durable
from moe_ft.store import MemoryBackend, SnapshotStore, StoreError

if TYPE_CHECKING:
    from moe_ft.config import FTConfig
    from moe_ft.drills.faults import FaultPlan
    from moe_ft.popularity import ExpertPopularity
    from moe_ft.snapshot.session import SnapshotSession
    from moe_ft.state.registry import OperatorRegistry

T = TypeVar("T")


@dataclass(kw_only=True, frozen=True)
class RecoveryInputs:
    """Everything one recovery reads or changes, read-only: the runtime's components are looked up by type
    (:meth:`find`), never passed as named handles."""

    config: "FTConfig"
    state: Any
    """The loop's ``TrainState`` (model chunks, optimizer with its state initialised, scheduler)."""
    args: Any
    """Megatron's parsed ``Args`` (batch size, sequence length, top-k, ``--save``, train iterations)."""
    rank: int
    world_size: int
    start_iteration: int
    """The ``--load`` iteration (or 0): recovery never restores a point older than it."""
    restart_count: int
    step_fn: Callable[[int, Any], Any]
    """``step_fn(iteration, optimizer)`` runs one training iteration (replay)."""
    registry: "OperatorRegistry"
    popularity: "ExpertPopularity"
    session: "SnapshotSession"
    components: tuple = ()
    """The runtime's components (``moe_ft/runtime/components.py`` and the packages' ``component.py``)."""
    faults: Optional["FaultPlan"] = None
    check_fault: Callable[[int, str], None] = lambda iteration, phase: None
    survivor: Any = None
    """This rank's :class:`moe_ft.localized.survivor.SurvivorGuard` (``None``: localized scope off)."""
    survivor_points: Any = None
    """This rank's survivor point, held in memory (``moe_ft.localized.survivor_points.HeldPoint``: the process
    stayed) or in its node store (``StoredPoints``), or ``None`` (localized scope off)."""

    def find(self, cls: type[T]) -> T | None:
        """The runtime's component of type ``cls`` (``None``: the job runs without it)."""
        return next((c for c in self.components if isinstance(c, cls)), None)


    @property
    def durable_dir(self) -> Path | None:
        """The durable tier's job directory (rank 0's progress record there outlives every node)."""
        durable = self.find(Durable)
        return durable.directory if durable is not None else None

    @property
    def upstream(self) -> UpstreamLogging | None:
        """The upstream-logging component (``moe_ft/localized/component.py``; ``None``: no logs)."""
        return self.find(UpstreamLogging)

    @property
    def log_dir(self):
        """The upstream log directory, every iteration queued for it published (``None``: no logs)."""
        upstream = self.upstream
        if upstream is None:
            return None
        upstream.drain()
        return upstream.log_dir


def phase_seconds(phases: dict, t0: float, since_fault: float | None) -> dict:
    """A report's ``seconds``: the recovery's phases, ``restore`` (this rank's state back: ``load`` plus
    ``fetch`` from peers), ``total`` since ``t0`` and ``restart`` (the fault to the start of recovery)."""
    out = {k: round(v, 4) for k, v in phases.items()}
    out["restore"] = round(phases.get("load", 0.0) + phases.get("fetch", 0.0), 4)
    out["total"] = round(time.perf_counter() - t0, 4)
    if since_fault is not None:
        out["restart"] = round(since_fault, 4)
    return out


def discard_survivor_points(inputs: RecoveryInputs) -> None:
    """The survivor points describe a state the job has left once it recovered (every path)."""
    if inputs.survivor_points is not None:
        inputs.survivor_points.discard()


def audit_path(inputs: RecoveryInputs) -> str:
    """The job's append-only recovery audit log (rank 0 writes it): ``<job dir>/recovery_audit.jsonl``."""
    return os.path.join(inputs.config.job_dir(), "recovery_audit.jsonl")


def last_fault_time(faults) -> float | None:
    """Drills: the wall time of the newest fired fault (its marker's mtime); ``None`` without fired faults."""
    fired = faults.fired() if faults else []
    if not fired:
        return None
    return max((faults.marker_dir / f.marker_name).stat().st_mtime for f in fired)


def seconds_since_last_fault(faults) -> float | None:
    """Drills: wall seconds from the newest fired fault to now, i.e. failure detection + restart + process
    start + model build; ``None`` without fired faults."""
    at = last_fault_time(faults)
    return None if at is None else time.time() - at


def durable_store(inputs: RecoveryInputs, newer_than: int):
    """``(this rank's durable store, end of the newest complete durable point)`` if that point is newer than
    ``newer_than`` (the ``--load`` checkpoint's last iteration), else ``None``. Same answer on every rank
    (the completion markers are shared)."""

    tier = durable_tier(inputs)
    if tier is None:
        return None
    ends = [e for e in tier.complete_points() if e > newer_than]
    if not ends:
        return None
    try:  # read only: a recovery creates nothing in the tier
        store = tier.reader(inputs.rank)
    except StoreError as e:  # its directory is gone although every rank marked its part done
        print(f"moe-ft recovery rank {inputs.rank}: the durable tier's complete points up to iteration {ends[-1]} "
              f"have no part of this rank ({e}): they cannot be restored", file=sys.stderr, flush=True)
        store = SnapshotStore(MemoryBackend())  # proposes no point: every rank passes the tier over alike
    return store, ends[-1]


def durable_tier(inputs: RecoveryInputs) -> DurableTier | None:
    """The job's durable tier at this world size (``None``: no ``--ft-persist-interval``)."""
    cfg = inputs.config
    root = cfg.persist.root(inputs.args.training.save)
    if not (cfg.persist.interval and root):
        return None
    return DurableTier(root, cfg.snapshot.job_id, inputs.world_size)
