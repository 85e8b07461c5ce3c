"""What a node still has after a restart: the previous incarnation's layout records and dense store points.

**Layout record** (``<store_dir>/<job>/elastic/rank<r>.json``, node-local, written atomically by every rank
after each iteration by :class:`LayoutRecorder`): the generation (bumped by every world change), world and
EP size, every MoE layer's replica map ``R[e][j]``, the cumulative expert loads (the popularity counters'
hard counts, the loads eq. 1 allocates from, Lazarus §4.1) and the iteration. A restarted job reads the
records its nodes kept to learn the plan it ran (same world: keep it; other world: re-plan from it).

**LayoutInventory** (:func:`node_inventory`): every point in this node's stores of the job -- the snapshot stores
``<job>/rank<r>`` and the survivor points ``<job>/survivor/rank<r>`` (``moe_ft/localized/survivor.py``) --
with the operators it holds at ``FULL`` and whether it has metadata. Only this node's files are read:
another node's state arrives over the network (``transfer.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moe_ft.localized.survivor import SURVIVOR_SUBDIR
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.store import StoreConfig

RECORD_DIR = "elastic"


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

    @staticmethod
    def from_json(text: str) -> "LayoutRecord":
        return LayoutRecord.from_dict(json.loads(text))

    @staticmethod
    def from_dict(raw: dict) -> "LayoutRecord":
        return LayoutRecord(generation=int(raw["generation"]), world_size=int(raw["world_size"]),
                            ep_size=int(raw["ep_size"]), iteration=int(raw["iteration"]),
                            plans={int(k): v for k, v in raw["plans"].items()},
                            loads={int(k): v for k, v in raw["loads"].items()})


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
    for r in sorted((r for r in records if r.generation == newest.generation), key=lambda r: r.iteration):
        plans.update(r.plans)
        loads.update(r.loads)
    return replace(newest, plans=dict(sorted(plans.items())), loads=dict(sorted(loads.items())))


@dataclass(frozen=True)
class StoreDir:
    """One store directory on this node: ``kind`` ``snapshot`` or ``survivor``, written by old ``rank``."""

    kind: str
    rank: int
    root: str
    """``StoreConfig.root`` and ``job_id`` that open it: ``<root>/<job_id>/rank<rank>``."""
    job_id: str

    def open(self):
        return StoreConfig(root=self.root, job_id=self.job_id, rank=self.rank).build()


def store_dirs(store_dir: str, job_id: str) -> list[StoreDir]:
    """The snapshot and survivor store directories of ``job_id`` on this node."""

    out = []
    job = Path(store_dir) / job_id
    for kind, root, name in (("snapshot", store_dir, job_id), ("survivor", str(job), SURVIVOR_SUBDIR)):
        for path in sorted((Path(root) / name).glob("rank*")):
            if path.is_dir() and path.name[4:].isdigit():
                out.append(StoreDir(kind, int(path.name[4:]), root, name))
    return out


@dataclass
class LayoutInventory:
    """``full[iteration][op]``: a store directory on this node holding ``op`` at FULL in that point;
    ``meta[iteration]``: directories with that point's metadata (the rank's own first)."""

    full: dict[int, dict[OperatorId, StoreDir]]
    meta: dict[int, list[StoreDir]]
    candidates: dict[int, dict[OperatorId, list[StoreDir]]] = field(default_factory=dict)
    """Every directory holding ``op`` at FULL in that point, in preference order (``full`` is the first):
    a corrupt entry is read from the next one."""

    def summary(self) -> dict[int, list[str]]:
        """``{iteration: [operator names FULL]}`` for points with metadata (what the ranks exchange)."""
        return {it: sorted(str(op) for op in ops) for it, ops in self.full.items() if it in self.meta}


def node_inventory(store_dir: str, job_id: str, *, prefer_rank: int) -> LayoutInventory:
    """Scan this node's stores (manifests only; checksums are verified when an entry is loaded)."""
    full: dict[int, dict[OperatorId, StoreDir]] = {}
    meta: dict[int, list[StoreDir]] = {}
    candidates: dict[int, dict[OperatorId, list[StoreDir]]] = {}
    dirs = sorted(store_dirs(store_dir, job_id), key=lambda d: (d.rank != prefer_rank, d.kind != "survivor", d.rank))
    for d in dirs:
        for point in d.open().catalog().points():
            ops = full.setdefault(point.iteration, {})
            for op, entry in point.entries.items():
                if entry.level == Level.FULL:
                    ops.setdefault(op, d)
                    candidates.setdefault(point.iteration, {}).setdefault(op, []).append(d)
            if point.meta is not None:
                meta.setdefault(point.iteration, []).append(d)
    return LayoutInventory(full, meta, candidates)
