"""What a node still has after a restart: the previous incarnation's layout records and dense store points.

**Layout record** (``<store_dir>/<job>/elastic/rank<r>.json``, node-local, written atomically by every rank
after each iteration by ``ElasticRecorder.after_iteration``, ``moe_ft/elastic/component.py``): the generation (bumped by every world change), world and
EP size, every MoE layer's replica map ``R[e][j]``, the cumulative expert loads (the popularity counters'
hard counts, the loads eq. 1 allocates from, Lazarus §4.1) and the iteration. A restarted job reads the
records its nodes kept to learn the plan it ran (same world: keep it; other world: re-plan from it).

**LayoutInventory** (:func:`node_inventory`): every point in this node's stores of the job -- the snapshot stores
``<job>/rank<r>``, the survivor points ``<job>/survivor/rank<r>`` (``moe_ft/localized/survivor_points.py``) and the
replicas this node holds for its peers ``<job>/replicas[/holder<h>]/rank<r>`` (a lost node's points live on
only there) -- with the operators it holds at ``FULL``, whether it has metadata and, with the distributed
optimizer, which elements of each parameter's optimizer state each copy holds (``moe_ft/state/shards.py``:
read from the manifest's tensor names). Only this node's files are read: another node's state arrives over
the network (``restore.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

from moe_ft.localized.survivor_points import SURVIVOR_SUBDIR
from moe_ft.state import shards
from moe_ft.state.naming import plan_free_name
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.store import StoreConfig

RECORD_DIR = "elastic"
REPLICA_SUBDIR = "replicas"
"""Where a node keeps its peers' replicas (``moe_ft/replication/receiver.py``)."""


@dataclass(frozen=True)
class LayoutRecord:
    """One rank's view of the incarnation it ran in (see the module docstring)."""

    generation: int
    world_size: int
    ep_size: int
    iteration: int
    plans: dict[int, list[list[int]]]
    """``{layer_idx: R[e][j]}`` of every elastic MoE layer."""
    loads: dict[int, list[float]]
    """``{layer_idx: tokens per expert}``, cumulative since the start of training."""
    sharded: dict[str, dict[str, int]] = field(default_factory=dict)
    """Distributed optimizer: ``{operator: {param (plan-free name): numel}}`` of every parameter of this
    rank's operators whose optimizer state is sharded, this rank's range empty or not: the elements a point
    must hold, over all its copies, to restore the operator (a copy that holds none of a parameter's
    elements cannot say so itself)."""

    @staticmethod
    def from_json(text: str) -> "LayoutRecord":
        return LayoutRecord.from_dict(json.loads(text))

    @staticmethod
    def from_dict(raw: dict) -> "LayoutRecord":
        return LayoutRecord(generation=int(raw["generation"]), world_size=int(raw["world_size"]),
                            ep_size=int(raw["ep_size"]), iteration=int(raw["iteration"]),
                            plans={int(k): v for k, v in raw["plans"].items()},
                            loads={int(k): v for k, v in raw["loads"].items()},
                            sharded={k: dict(v) for k, v in raw.get("sharded", {}).items()})


def record_dir(store_dir: str, job_id: str) -> Path:
    return Path(store_dir) / job_id / RECORD_DIR


def write_record(store_dir: str, job_id: str, rank: int, record: LayoutRecord) -> None:
    """Atomic (write, then rename): a reader sees the old record or the new one."""
    directory = record_dir(store_dir, job_id)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, directory / f"rank{rank}.json")


def read_records(store_dir: str, job_id: str) -> list[LayoutRecord]:
    """Every layout record this node kept (unreadable ones are skipped: a torn write never renamed)."""
    out = []
    for path in sorted(record_dir(store_dir, job_id).glob("rank*.json")):
        try:
            out.append(LayoutRecord.from_json(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue
    return out


def newest_record(records: list[LayoutRecord]) -> LayoutRecord | None:
    """The record of the newest generation, newest iteration within it, with the plans and loads of every
    MoE layer: with pipeline parallelism a rank records its own stage's layers only, so each layer's plan
    and loads come from the newest record of that generation that has the layer."""
    newest = max(records, key=lambda r: (r.generation, r.iteration), default=None)
    if newest is None:
        return None
    plans, loads = {}, {}
    sharded: dict[str, dict[str, int]] = {}
    for r in sorted((r for r in records if r.generation == newest.generation), key=lambda r: r.iteration):
        plans.update(r.plans)
        loads.update(r.loads)
        for op, params in r.sharded.items():
            sharded.setdefault(op, {}).update(params)
    return replace(newest, plans=dict(sorted(plans.items())), loads=dict(sorted(loads.items())),
                   sharded=dict(sorted(sharded.items())))


@dataclass(frozen=True)
class StoreDir:
    """One store directory on this node: ``kind`` ``snapshot``, ``survivor`` or ``replica`` (held for a peer),
    of old ``rank``."""

    kind: str
    rank: int
    root: str
    """``StoreConfig.root`` and ``job_id`` that open it: ``<root>/<job_id>/rank<rank>``."""
    job_id: str

    @property
    def config(self) -> StoreConfig:
        return StoreConfig(root=self.root, job_id=self.job_id, rank=self.rank)

    def open(self):
        return self.config.build()


def store_dirs(store_dir: str, job_id: str) -> list[StoreDir]:
    """The snapshot, survivor and replica store directories of ``job_id`` on this node."""

    out = []
    job = Path(store_dir) / job_id
    homes = [("snapshot", store_dir, job_id), ("survivor", str(job), SURVIVOR_SUBDIR),
             ("replica", store_dir, f"{job_id}/{REPLICA_SUBDIR}")]
    homes += [("replica", store_dir, f"{job_id}/{REPLICA_SUBDIR}/{p.name}")
              for p in sorted((job / REPLICA_SUBDIR).glob("holder*")) if p.is_dir()]
    for kind, root, name in homes:
        for path in sorted((Path(root) / name).glob("rank*")):
            if path.is_dir() and path.name[4:].isdigit():
                out.append(StoreDir(kind, int(path.name[4:]), root, name))
    return out


def old_generation_share(dirs: list[StoreDir], *, rank: int, ranks_here: set[int],
                         world_size: int) -> tuple[list[StoreDir], list[StoreDir]]:
    """``(to empty, to remove)``: rank ``rank``'s share of dropping the previous generation's points from its
    node's store directories ``dirs`` (:func:`store_dirs`), after a reshape restore or a ``fallback`` decision.
    ``ranks_here``: the new world's ranks that share this node's store root.

    Every directory goes, whoever's it was, and each is one rank's job: a rank empties those with its own
    number (its snapshot and survivor stores, which it writes again, and replicas of that number); the node's
    lowest rank takes the others. It removes those of ranks the new world does not have and the snapshot and
    survivor stores of ranks that run on other nodes now (no rank here writes them), and empties the replica
    stores of the other ranks without removing them (the new placement may make a rank here their holder,
    whose receiver, or node agent, keeps the store open). Pure."""
    mine = [d for d in dirs if d.rank == rank]
    if rank != min(ranks_here):
        return mine, []
    others = [d for d in dirs if d.rank not in ranks_here]
    remove = [d for d in others if d.rank >= world_size or d.kind != "replica"]
    return mine + [d for d in others if d not in remove], remove


Ranges = dict[str, tuple[int, int, int]]
"""``{param (plan-free name): (start, end, numel)}`` of a copy's sharded optimizer state; ``{}``: none."""


@dataclass
class LayoutInventory:
    """``full[iteration][op]``: a store directory on this node holding ``op`` at FULL in that point;
    ``meta[iteration]``: directories with that point's metadata (the rank's own first)."""

    full: dict[int, dict[OperatorId, StoreDir]]
    meta: dict[int, list[StoreDir]]
    candidates: dict[int, dict[OperatorId, list[StoreDir]]] = field(default_factory=dict)
    """Every directory holding ``op`` at FULL in that point, in preference order (``full`` is the first):
    a corrupt entry is read from the next one."""
    ranges: dict[int, dict[OperatorId, list[Ranges]]] = field(default_factory=dict)
    """The sharded elements each copy of :attr:`candidates` holds (same order)."""
    meta_stage: dict[int, list[frozenset[str]]] = field(default_factory=dict)
    """Whose metadata each directory of :attr:`meta` holds (same order): :func:`stage_atoms` of the operators
    of its point. The metadata is per pipeline stage (RNG seeded per stage, the per-group learning rates a
    CheckFree boost raised, the recorded gradient norm), so a rank restores only its own stage's."""

    def summary(self) -> dict[int, dict[str, list[Ranges]]]:
        """``{iteration: {operator name: [ranges of each distinct copy]}}`` of the operators held at FULL, for
        points with metadata (what the ranks exchange)."""
        out = {}
        for it, ops in self.full.items():
            if it in self.meta:
                out[it] = {str(op): _distinct(self.ranges.get(it, {}).get(op, [{}])) for op in sorted(ops)}
        return out


def stage_atoms(ops: Iterable[OperatorId]) -> frozenset[str]:
    """What tells pipeline stages apart in a set of operators: their transformer layers (``L<k>``, global
    indices) and the embedding / output layer. The same on every rank of a stage whatever its data- or
    expert-parallel coordinates (those hold other experts of the same layers), disjoint between stages."""
    return frozenset(f"L{op.layer}" if op.layer >= 0 else op.kind for op in ops)


def _distinct(copies: list[Ranges]) -> list[Ranges]:
    out: list[Ranges] = []
    for r in copies:
        if r not in out:
            out.append(r)
    return out


def node_inventory(store_dir: str, job_id: str, *, prefer_rank: int) -> LayoutInventory:
    """Scan this node's stores (manifests only; checksums are verified when an entry is loaded)."""
    full: dict[int, dict[OperatorId, StoreDir]] = {}
    meta: dict[int, list[StoreDir]] = {}
    candidates: dict[int, dict[OperatorId, list[StoreDir]]] = {}
    ranges: dict[int, dict[OperatorId, list[Ranges]]] = {}
    meta_stage: dict[int, list[frozenset[str]]] = {}
    kinds = {"survivor": 0, "snapshot": 1, "replica": 2}  # a replica is read only where no own copy serves
    dirs = sorted(store_dirs(store_dir, job_id), key=lambda d: (d.rank != prefer_rank, kinds[d.kind], d.rank))
    for d in dirs:
        for point in d.open().catalog().points():
            ops = full.setdefault(point.iteration, {})
            for op, entry in point.entries.items():
                if entry.level == Level.FULL:
                    ops.setdefault(op, d)
                    candidates.setdefault(point.iteration, {}).setdefault(op, []).append(d)
                    ranges.setdefault(point.iteration, {}).setdefault(op, []).append(
                        shards.ranges_of(plan_free_name(t.name) for t in entry.tensors))
            if point.meta is not None:
                meta.setdefault(point.iteration, []).append(d)
                meta_stage.setdefault(point.iteration, []).append(stage_atoms(point.entries))
    return LayoutInventory(full, meta, candidates, ranges, meta_stage)
