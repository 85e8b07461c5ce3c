"""Whether this job can recover from the durable tier it writes to (``--ft-persist-dir``, ``--ft-job-id``).

* Points written by another number of ranks split the state another way: a start of this world size could
  not load them, and its retention would delete them once it wrote newer points of its own.
  :func:`other_world_error` is the one line that stops such a start (``FTRuntime._check_durable_tier``, exit
  2, before the tier is read or changed), as the fresh-start check does for the node-local store
  (``moe_ft/recovery/fresh_start.py``).
* Points written by a model of other flags (``--num-experts``, ``--hidden-size``, ``--num-layers``) hold other
  operators or other tensors: :func:`durable_misfit` finds it from the manifests, and the recovery's first
  step stops every rank with :func:`durable_misfit_error` (``moe_ft/recovery/driver.py``), before anything is
  restored or deleted. Before, the planner started over without a word about the tier (its retention then
  replaced the points) or the restore stopped with a traceback.
"""

from __future__ import annotations

from moe_ft.persist.durable import DurableTier
from moe_ft.snapshot.restore import entry_misfit
from moe_ft.store import StoreError
from moe_ft.store.backend import MANIFEST
from moe_ft.store.manifest import decode_manifest


def other_world_error(tier: DurableTier, *, newer_than: int, elastic_hint: bool) -> str | None:
    """The line that refuses a start of ``tier.world_size`` ranks whose durable tier holds a complete point of
    another world size newer than ``newer_than`` (the ``--load`` checkpoint's last iteration) and than every
    point of this world size, or ``None``. ``elastic_hint``: this start is no elastic job but the node kept the
    layout records of one (``--ft-elastic`` may reshape the node-local copies onto this world)."""
    point = tier.newer_other_world(newer_than)
    if point is None:
        return None
    world = point.world_size
    written = f"written by {world} ranks" if world is not None else "written by another number of ranks"
    n = tier.world_size
    relaunch = f"relaunch on {world} ranks to recover from them" if world is not None else \
        "relaunch on the world size that wrote them to recover from them"
    elastic = f", pass --ft-elastic to reshape the node-local copies onto {n} rank{'s' if n > 1 else ''}" \
        if elastic_hint else ""
    return (f"the durable tier {tier.directory} holds complete recovery points up to iteration {point.end} "
            f"{written}, and this job has {n} rank{'s' if n > 1 else ''}: it cannot load them (they split the "
            f"state another way) and its retention would delete them; {relaunch}{elastic}, pass a new "
            f"--ft-job-id to start over, or delete {tier.directory}")


def durable_misfit(tier: DurableTier, end: int, rank: int, registry) -> str | None:
    """Why rank ``rank``'s part of the complete point ending at ``end`` cannot restore this rank's model
    (``registry``), or ``None``: the part lacks an operator this model has (more layers or experts), or an entry
    it stores holds other tensors than this model's operator (another hidden size, another router width).
    Only manifests are read, nothing is created; a part that cannot be read is left to the recovery, which
    verifies what it restores and says why it passes a point over."""
    try:
        part = tier.complete(end).parts.get(rank)
        store = tier.reader(rank)
    except (StoreError, OSError, ValueError, KeyError):
        return None
    if part is None:
        return None
    lacking = [str(op) for op in registry if op not in part.full_at]
    if lacking:
        return f"it holds no {', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''} of rank {rank}"
    for iteration in part.iterations:
        try:
            record = decode_manifest(store.backend.read_blob(iteration, MANIFEST), iteration,
                                     f"{store.backend.describe()} iteration {iteration}")
        except (StoreError, OSError, ValueError, KeyError):
            continue
        wanted = {(ref.op, ref.level) for ref in part.entries if ref.iteration == iteration}
        for entry in record.all_entries():
            if (entry.op, entry.level) in wanted and (problem := entry_misfit(registry, entry)) is not None:
                return problem
    return None


def durable_misfit_error(tier: DurableTier, end: int, problem: str) -> str:
    """The one line that stops a recovery whose newest complete durable point does not fit the model."""
    return (f"the durable point ending at iteration {end} in {tier.directory} does not fit this model ({problem}): "
            f"relaunch with the model flags of the run that wrote it to recover from it, pass a new --ft-job-id "
            f"to start over, or delete {tier.directory}")
