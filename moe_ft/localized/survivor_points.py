"""A rank's survivor point as recovery reads it (``survivor.py`` makes it): published in its node store
(:class:`StoredPoints`) or held in the memory of a process that stays (:class:`HeldPoint`, ``moe-ft launch``).
Recovery reads either kind through the same four calls (``newest``, ``load``, ``meta``, ``discard``):
:class:`StoredPoints` wraps the store, :class:`HeldPoint` is the memory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from moe_ft.snapshot.restore import copy_checked, restore_meta, restore_operator
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig
from moe_ft.store.rules import DenseRule

SURVIVOR_SUBDIR = "survivor"
"""Survivor points live in ``<store_dir>/<job_id>/survivor/rank<r>`` (next to the snapshot store)."""


@dataclass
class PublishResult:
    """What :meth:`SurvivorGuard.publish` did: ``iteration`` published (``None``: nothing) and why."""

    iteration: int | None
    reason: str
    nbytes: int = 0
    seconds: float = 0.0


def survivor_store(store_root: str, job_id: str, rank: int):
    """This rank's survivor-point store (a :class:`moe_ft.store.SnapshotStore` without retention: it holds
    at most one point, replaced by each dump)."""

    return StoreConfig(root=store_root, job_id=os.path.join(job_id, SURVIVOR_SUBDIR), rank=rank).build()


def survivor_rule(operators):
    """Completeness of a survivor point: every operator of the rank FULL, plus the metadata entry."""

    return DenseRule(operators=frozenset(operators))


def newest_survivor_point(store, operators) -> tuple[int, str]:
    """``(iteration, "")`` of this rank's verified survivor point (every entry checksummed), or
    ``(-1, why not)``."""
    points = store.points()
    if not points:
        torn = store.staging()
        return -1, ("its dump did not finish (an unpublished staging directory remains)" if torn
                    else "it published no survivor point")
    point = store.newest_recoverable(survivor_rule(operators), verify=True)
    if point is None:
        return -1, f"its survivor point {points[-1]} is incomplete or corrupt (a checksum failed)"
    return point.end, ""


class StoredPoints:
    """This rank's survivor points in its node store (what recovery reads after a process restart)."""

    def __init__(self, store) -> None:
        self.store = store

    def newest(self, operators) -> tuple[int, str]:
        return newest_survivor_point(self.store, operators)

    def load(self, registry, iteration: int) -> int:
        return load_survivor_point(self.store, registry, iteration)

    def meta(self, iteration: int) -> tuple[dict, dict[str, torch.Tensor]]:
        return restore_meta(self.store, iteration)

    def newest_meta(self) -> tuple[str, dict] | None:
        """``(what it is, metadata)`` of the newest point published, unverified (``None``: none)."""
        points = self.store.points()
        if not points:
            return None
        return (f"the survivor point of iteration {points[-1]} in {self.store.backend.describe()}",
                restore_meta(self.store, points[-1])[0])

    def discard(self) -> None:
        discard_survivor_points(self.store)


@dataclass(eq=False)
class HeldPoint:
    """A survivor point held in memory by a process that stays (``moe-ft launch``): the failed attempt's
    tensors as of the completed iteration, on the host. Read by the next attempt's recovery in this process
    (the same calls as :class:`StoredPoints`), or written to the node store by :meth:`spill`."""

    iteration: int
    rank: int
    """The rank whose state it is (the attempt that held it; a reshape may renumber the process)."""
    entries: dict[OperatorId, dict[str, torch.Tensor]]
    step_meta: dict
    """The metadata of :attr:`iteration` (RNG, schedule, popularity, policy; ``moe_ft/snapshot/meta.py``)."""
    tensors: dict[str, torch.Tensor]
    store_root: str
    job_id: str
    nbytes: int = 0
    discarded: bool = False

    def newest(self, operators) -> tuple[int, str]:
        if self.discarded:
            return -1, "its held point was discarded"
        if set(operators) != set(self.entries):
            return -1, (f"its held point of iteration {self.iteration} does not match this attempt's operators "
                        "(the model was re-planned)")
        return self.iteration, ""

    @torch.no_grad()
    def load(self, registry, iteration: int) -> int:
        self._check(iteration)
        return sum(copy_checked(registry[op], registry[op].tensors(Level.FULL), self.entries[op],
                                what=f"held survivor point {op} @ {iteration}", fix="restore into the same layout")
                   for op in registry)

    def meta(self, iteration: int) -> tuple[dict, dict[str, torch.Tensor]]:
        self._check(iteration)
        return dict(self.step_meta), dict(self.tensors)

    def newest_meta(self) -> tuple[str, dict] | None:
        """``(what it is, metadata)`` of the point held (``None``: discarded)."""
        if self.discarded:
            return None
        return f"the survivor point of iteration {self.iteration} held by rank {self.rank}", dict(self.step_meta)

    def discard(self) -> None:
        """The job recovered past this state: free the tensors."""
        self.discarded = True
        self.entries, self.tensors = {}, {}

    def _check(self, iteration: int) -> None:
        if self.discarded or iteration != self.iteration:
            raise RuntimeError(f"rank {self.rank} holds no survivor point of iteration {iteration} "
                               f"(held: {'none' if self.discarded else self.iteration})")

    def spill(self) -> PublishResult:
        """Write the point into this rank's node store as a published survivor point (a process restart or
        a reshaped job reads it there)."""
        start = time.monotonic()
        if self.discarded:
            return PublishResult(None, "nothing held")
        store = survivor_store(self.store_root, self.job_id, self.rank)
        nbytes = write_point(store, self.iteration, ((op, self.entries[op]) for op in sorted(self.entries, key=str)),
                              self.step_meta, self.tensors) or 0
        return PublishResult(self.iteration, "spilled", nbytes, time.monotonic() - start)


def write_point(store, iteration: int, entries, meta: dict, meta_tensors: Mapping[str, torch.Tensor],
                 out_of_time: Callable[[], bool] = lambda: False) -> int | None:
    """Publish ``entries`` (``(op, tensors)``, every operator FULL) and the metadata as this rank's one
    survivor point, of ``iteration`` (one rename at the end; the older points stay until it is published:
    a dump that dies leaves them); ``None`` when ``out_of_time()`` said stop (nothing published)."""
    previous = store.points()
    if iteration in previous:
        store.delete_point(iteration)
    nbytes = 0
    with torch.no_grad(), store.begin(iteration) as point:
        for op, tensors in entries:
            tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
            nbytes += point.put(op, Level.FULL, tensors).nbytes
            if out_of_time():
                return None
        point.put_meta(meta, {k: v.detach().cpu().contiguous() for k, v in meta_tensors.items()})
        point.publish()
    for old in previous:  # one point per rank: the newest stop's
        if old != iteration:
            store.delete_point(old)
    return nbytes


def load_survivor_point(store, registry, iteration: int) -> int:
    """Restore every operator FULL from the survivor point of ``iteration``; returns the bytes read. The
    step state (RNG, schedule, popularity, policy) is in its metadata (``restore_meta``)."""

    return sum(restore_operator(store, registry, iteration, op, Level.FULL) for op in registry)


def discard_survivor_points(store) -> None:
    """After a recovery: the points describe a state the job has left."""
    for it in store.points():
        store.delete_point(it)
