"""Restore every operator after a reshape (``restart.py`` decided the new plans and the point ``T``).

Lazarus §4.3 moves expert state from surviving holders to the ranks that need it, spread over all
holders; non-expert state comes from data-parallel peers. Here every rank of the new world, with its
operator registry built for the new plan (``FTRuntime.build``):

1. loads, from its own node's stores, every operator that some point ``T`` there holds at FULL (weights,
   fp32 master, Adam moments, step; ``moe_ft/elastic/inventory.py``: survivor points or dense snapshots of
   any old rank of the node) -- node-local, nothing crosses the network;
2. receives the rest from a peer whose node has them: the fetches are dealt over every rank that can serve
   an operator, least-loaded first, and run in one global order (each pair of ranks meets its transfers in
   the same order, so the blocking sends and receives of the coordination group cannot deadlock);
3. restores the step state of ``T`` (RNG, LR schedule, loss scaler, popularity) from its node's metadata or
   a peer's -- written by a rank of its own pipeline stage (``choose_meta``: the ranks are numbered again in
   the new world, and the metadata holds the stage's RNG states and per-group learning rates) -- then, after a
   barrier, empties the old generation's store directories on its node (their points hold the old plan's
   operators) so that the new generation's snapshots start clean. Before it restores anything, the metadata of
   ``T`` is checked against the flags' LR schedule and global batch size (``moe_ft/recovery/schedule.py``,
   every rank; a refusal stops every rank and leaves the stores as they were).

Training resumes at ``T + 1`` with the same global batch (``ReplayableData``: ``GBS / (MBS x DP)``
micro-batches per rank on the new data-parallel size). The math equals the fault-free run up to float
summation order (gradients of the same global batch are summed over other ranks and micro-batches), so the
result is close, not bitwise (``docs/elastic.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
from collections import defaultdict
from pathlib import Path

import torch

from moe_ft import comm
from moe_ft.checkfree.config import COPIES_DIRNAME
from moe_ft.elastic.inventory import node_inventory, old_generation_share, stage_atoms, store_dirs
from moe_ft.localized.component import upstream_root
from moe_ft.recovery.machine import restore_step_state
from moe_ft.recovery.schedule import ScheduleRule, stop_unless_agreed
from moe_ft.replication.component import Replicas
from moe_ft.snapshot.restore import assemble_into, copy_checked, restore_meta
from moe_ft.state import shards
from moe_ft.state.naming import plan_free_name
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.optimizer_views import ensure_optimizer_state
from moe_ft.store.errors import CorruptEntryError

META = "__meta__"


def assign_sources(needs: list[list[str]], haves: list[set[str]]) -> list[tuple[int, int, str]]:
    """``(src, dst, name)`` for every name rank ``dst`` needs, from the least-loaded rank that has it
    (ties: lowest rank); raises ``RuntimeError`` for a name nobody has. Pure; the order is global."""
    load: dict[int, int] = defaultdict(int)
    out = []
    for dst, names in enumerate(needs):
        for name in names:
            candidates = [r for r, have in enumerate(haves) if name in have and r != dst]
            if not candidates:
                raise RuntimeError(f"rank {dst} needs {name} at the agreed point but no rank's node has it")
            src = min(candidates, key=lambda r: (load[r], r))
            load[src] += 1
            out.append((src, dst, name))
    return out


@torch.no_grad()
def copy_into(registry, op: OperatorId, tensors: dict[str, torch.Tensor]) -> int:
    """Copy an entry written under any plan into this rank's live tensors of ``op`` (FULL); returns bytes."""
    return copy_checked(registry[op], registry[op].tensors(Level.FULL), tensors, what=f"{op}: the stored entry",
                        fix="the model flags must be those of the run that wrote it")


class ElasticRestoreFailed(RuntimeError):
    """Raised on every rank alike when an operator of the agreed point has no readable copy left (every
    copy corrupt): the points with corrupt entries were deleted from this node's stores first, so the next
    start decides on another point instead of failing the same way."""


MAX_ROUNDS = 4
"""Verification rounds: each round can only remove sources, so a few settle every case seen."""


def _read_verified(candidates: list, read, bad: set, key: str, corrupt: list) -> tuple[object, object] | None:
    """``(payload, directory)`` of the first candidate directory's copy ``key`` that reads back verified
    (``read(dir)``); a copy that fails its checksum (or cannot be read) is marked ``bad``, recorded in
    ``corrupt`` (under its operator's name) and skipped."""
    for d in candidates:
        if (d, key) in bad:
            continue
        try:
            return read(d), d
        except (CorruptEntryError, OSError, ValueError, KeyError) as e:
            bad.add((d, key))
            corrupt.append({"rank": d.rank, "kind": d.kind, "name": coverage_name(key),
                            "error": f"{type(e).__name__}: {e}"[:300]})
    return None


def copy_key(op_name: str, ranges: dict) -> str:
    """What the ranks exchange for one copy of an operator: its name for a whole copy; with the distributed
    optimizer the name and a digest of the elements it holds (copies of one old rank's shard, in its own
    store and in a peer's replica store, are interchangeable)."""
    if not ranges:
        return op_name
    digest = hashlib.sha1(json.dumps(sorted((p, list(r)) for p, r in ranges.items())).encode()).hexdigest()[:12]
    return f"{op_name}@{digest}"


def meta_key(stage: frozenset[str]) -> str:
    """What the ranks exchange for the metadata of one pipeline stage (:func:`stage_atoms`)."""
    return f"{META}@{hashlib.sha1(json.dumps(sorted(stage)).encode()).hexdigest()[:12]}"


def choose_meta(stage: frozenset[str], offers: list[tuple[str, dict]]) -> tuple[str, str]:
    """``(key, error)``: the first metadata copy (``offers``: ``(key, {"stage": atoms})`` in preference order)
    written by a rank of this rank's pipeline stage (``stage``: :func:`stage_atoms` of its registry), i.e. whose
    point's operators are this stage's. Another stage's would restore that stage's RNG states and per-group
    learning rates (a CheckFree-boosted stage's boost would move to its neighbour)."""
    for key, held in offers:
        if held["stage"] and set(held["stage"]) <= stage:
            return key, ""
    layers = sorted(int(a[1:]) for a in stage if a.startswith("L"))
    return "", (f"{META}: no node has the metadata of this rank's pipeline stage (layers {layers}) at the point; "
                f"copies offered: {sorted(tuple(held['stage']) for _, held in offers)}")


def choose_copies(registry, offers: dict[str, list[tuple[str, dict]]]) -> tuple[dict[str, list[str]], str]:
    """``({operator: [copy keys]}, error)``: for every operator of this rank, the copies to restore it from
    (``offers``: per operator ``(key, ranges)`` in preference order): one for a whole copy, with the
    distributed optimizer as many as it takes to cover this rank's new shard of every parameter
    (``shards.pick_copies``). ``error`` names the first operator no set of copies restores."""
    out: dict[str, list[str]] = {}
    for op in registry:
        name = str(op)
        live = (plan_free_name(n) for n in registry[op].tensors(Level.FULL))
        needed = {p: (s, e) for p, (s, e, _) in shards.ranges_of(live).items() if s < e}
        try:
            chosen = shards.pick_copies(needed, offers.get(name, []))
        except ValueError as e:
            return out, f"{name}: {e}"
        if not chosen:
            return out, f"{name}: no rank's node has it"
        out[name] = chosen
    return out, ""


def restore_reshaped(decision, runtime) -> dict:
    """Collective: restore this rank at ``decision.iteration`` (see the module docstring); returns the
    report section (bytes and operators local / from peers, seconds, copies excluded as corrupt).

    Every entry this rank loads or sends is read, and its checksum verified, before anything moves. A
    corrupt copy is excluded and the next copy on the node taken; the ranks then exchange what they have
    and need again (three all-gathers per round: the copies each node offers, the copies each rank
    takes, then whether any rank found a copy corrupt), so an operator whose copies on one node are all corrupt comes from another node. Every rank
    sees the same gathered state, so all of them go on or, when an operator has no readable copy anywhere,
    all raise :class:`ElasticRestoreFailed` together (after deleting the points with corrupt entries from
    their node's stores: the next start decides on another point).

    With the distributed optimizer a copy holds one old rank's range of each parameter's optimizer state
    (``moe_ft/state/shards.py``); a rank takes the copies whose ranges cover its new shard and assembles it
    from their pieces."""

    t0 = time.perf_counter()
    cfg, rank, point = runtime.config, runtime.rank, decision.iteration
    store_dir, job = cfg.snapshot.store_dir, cfg.snapshot.job_id
    ensure_optimizer_state(runtime.state.optimizer)
    runtime.build(t_iter_s=1.0)
    registry = runtime.registry
    inventory = node_inventory(store_dir, job, prefer_rank=rank)
    local: dict[str, list] = {}  # copy key -> this node's directories holding it, in preference order
    coverage: dict[str, tuple[str, dict]] = {}
    for op, dirs in inventory.candidates.get(point, {}).items():
        for d, ranges in zip(dirs, inventory.ranges[point][op]):
            key = copy_key(str(op), ranges)
            local.setdefault(key, []).append(d)
            coverage[key] = (str(op), ranges)
    for d, stage in zip(inventory.meta.get(point, []), inventory.meta_stage.get(point, [])):
        key = meta_key(stage)  # the metadata is per pipeline stage: keyed by whose it is
        local.setdefault(key, []).append(d)
        coverage[key] = (META, {"stage": sorted(stage)})
    my_stage = stage_atoms(registry)
    opened: dict = {}

    def store_of(d):
        if d not in opened:
            opened[d] = d.open()
        return opened[d]

    def read(key: str):
        def from_dir(d):
            if coverage[key][0] == META:
                return restore_meta(store_of(d), point)
            return store_of(d).load(point, OperatorId.parse(coverage[key][0]), Level.FULL)
        return from_dir

    bad: set = set()
    loaded: dict[str, object] = {}
    served_by: dict[str, object] = {}  # copy key -> the directory it was read from
    excluded: list[dict] = []
    for _ in range(MAX_ROUNDS):
        have = {key for key, dirs in local.items() if any((d, key) not in bad for d in dirs)}
        offered = comm.all_gather_object({"have": {k: coverage[k] for k in sorted(have)}, "corrupt": excluded})
        corrupt_anywhere = [c for g in offered for c in g["corrupt"]]
        offers: dict[str, list[tuple[str, dict]]] = {}
        for g in [offered[rank], *offered]:  # this rank's own copies first
            for key, (name, ranges) in g["have"].items():
                if key not in (k for k, _ in offers.get(name, [])):
                    offers.setdefault(name, []).append((key, ranges))
        choice, error = choose_copies(registry, offers)
        my_meta, meta_error = choose_meta(my_stage, offers.get(META, []))
        error = error or meta_error
        mine = [k for keys in choice.values() for k in keys] + ([my_meta] if my_meta else [])
        needs = comm.all_gather_object({"need": [k for k in mine if k not in have], "error": error})
        errors = [f"rank {r}: {g['error']}" for r, g in enumerate(needs) if g["error"]]
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            transfers = assign_sources([g["need"] for g in needs], [set(g["have"]) for g in offered])
        except RuntimeError as e:
            # copies missing elements of a new shard: no start on this world can restore the point, so it goes
            # from every store of the node (the next start decides on another); corrupt copies: their points go
            _quarantine({(d, k) for k, dirs in local.items() for d in dirs} if errors else bad, point)
            raise ElasticRestoreFailed(
                f"the agreed point {point} cannot be restored: {e}; copies excluded as corrupt: "
                f"{_describe(corrupt_anywhere)}. The point was deleted from the node stores that "
                f"{'held it' if errors else 'had corrupt copies'}: the next start decides on another point") from None
        wanted = [k for k in mine if k in have] + [key for src, _, key in transfers if src == rank]
        found: list[dict] = []
        for key in dict.fromkeys(wanted):
            if key not in loaded:
                got = _read_verified(local.get(key, []), read(key), bad, key, found)
                if got is not None:
                    loaded[key], served_by[key] = got
        excluded += found
        if not any(comm.all_gather_object(bool(found))):
            break
    else:
        raise ElasticRestoreFailed(f"copies of point {point} kept failing verification after {MAX_ROUNDS} rounds")

    stats = {"operators_local": 0, "bytes_local": 0, "operators_peer": 0, "bytes_peer": 0, "bytes_sent": 0,
             "copies_assembled": 0, "copies_from_replicas": 0}
    group = comm.coordination_group()
    for src, dst, key in transfers:
        if rank == src:
            payload = loaded[key]
            if coverage_name(key) != META:
                stats["bytes_sent"] += sum(t.nbytes for t in payload.values())
            comm.send_object(payload, dst, group)
        elif rank == dst:
            loaded[key] = comm.recv_object(src, group)
    # Megatron-LM's LR-schedule rule (moe_ft/recovery/schedule.py), on every rank before anything is restored
    # or a store emptied: the point was saved by the old world's run, whose flags may differ
    rule = ScheduleRule(training=runtime.args.training)
    stop_unless_agreed(rule.problem(loaded[my_meta][0], f"the snapshot of iteration {point} (the reshape's point)"), rank)
    fetched = {key for _, dst, key in transfers if dst == rank}
    for op in registry:
        keys = choice[str(op)]
        sources = [loaded[k] for k in keys]
        if len(sources) == 1 and not registry[op].sharded:
            nbytes = copy_into(registry, op, sources[0])
        else:
            nbytes = assemble_into(registry[op], sources, what=f"{op} at iteration {point}")
        if len(keys) > 1:  # a shard assembled from the pieces of several copies
            stats["copies_assembled"] += len(keys)
        kind = "peer" if fetched & set(keys) else "local"
        stats[f"bytes_{kind}"] += nbytes
        stats[f"operators_{kind}"] += 1
    stats["copies_from_replicas"] = sum(getattr(d, "kind", "") == "replica" for d in served_by.values())
    meta = loaded[my_meta]
    restore_step_state(meta[0], meta[1], train_state=runtime.state, popularity=runtime.popularity)
    rule.after_restore(runtime.state)
    opened.clear()
    loaded.clear()
    stats["seconds"] = round(time.perf_counter() - t0, 4)
    per_rank = comm.all_gather_object({**stats, "excluded": excluded})  # also the barrier: old points read
    discard_old_generation(runtime, store_dir, job)
    totals = {k: sum(r[k] for r in per_rank) for k in stats if k != "seconds"}
    return {**totals, "seconds": max(r["seconds"] for r in per_rank), "per_rank": per_rank,
            "transfers": [[src, dst, coverage_name(key)] for src, dst, key in transfers],
            "excluded": [dict(c, reader=r) for r, pr in enumerate(per_rank) for c in pr["excluded"]]}


def coverage_name(key: str) -> str:
    """The operator a copy key names (:func:`copy_key`)."""
    return key.split("@", 1)[0]


def _describe(corrupt: list[dict]) -> str:
    return "; ".join(f"{c['name']} of old rank {c['rank']} ({c['kind']}): {c['error']}" for c in corrupt) or "none"


def _quarantine(bad: set, point: int) -> None:
    """Delete ``point`` from every store directory in which this rank found a corrupt entry of it."""
    for d in {d for d, _ in bad}:
        with contextlib.suppress(Exception):  # already deleted by another rank of the node
            d.open().delete_point(point)


def discard_old_generation(runtime, store_dir: str, job_id: str) -> None:
    """After a reshape restore: empty this rank's snapshot store (old plan) and drop the replicas it holds,
    then :func:`discard_node_points` for the rest of the node (collective)."""
    runtime.active.store.discard_after(-1)
    replicas = runtime.find(Replicas)
    if replicas is not None and replicas.replication is not None:
        replicas.replication.discard_after(-1)
    discard_node_points(store_dir, job_id, runtime.rank, runtime.world_size)


def discard_if_behind(decision, store_dir: str, job_id: str, rank: int, world_size: int) -> None:
    """Collective when some rank is ``decision.behind`` (``restart.RestartDecision``): the nodes of those ranks
    drop every point of their stores (:func:`discard_node_points`) before anything reads them. Such a node ran
    no rank of the generation that just ended -- it waited as a spare (``standby.py``: a node of spares only
    runs no rank of the new world, so the world change that made it one did not sweep it) -- and what it holds
    is an older generation's: other rank numbers and plan, and points of a timeline the job may have left (the
    older generation's iterations after the point its successor restored). The decision did not count them.
    Kept, a reshape would restore them (iteration 9 of the generation before, not the 7 of the one that just
    ended), and the usual recovery serve them as the points of the rank that now has their number."""
    if decision.behind:
        discard_node_points(store_dir, job_id, rank, world_size, drop=rank in decision.behind)


def discard_node_points(store_dir: str, job_id: str, rank: int, world_size: int, *, drop: bool = True) -> None:
    """Collective: drop every point of the previous generation from this node's stores -- the snapshot and
    survivor points of the ranks that ran here, the replicas the node held for any rank of the old world and the
    CheckFree+ copies its holders kept (:func:`old_copy_dirs`), the upstream logs of old rank numbers no rank here
    has --, each directory by one rank of the node (:func:`~moe_ft.elastic.inventory.old_generation_share`). They
    hold the old world's plan and shards, and a rank of the new world with an old rank's number is not that
    rank: kept, the usual recovery would fetch them as its points, and the next decision count them. Every rank
    read its node's inventory before this (the decision's all-gather; a reshape's restore, then a barrier), so
    nothing still needs them. The durable tier is not touched. ``drop=False``: this rank only takes part in the
    collective (:func:`discard_if_behind`)."""

    # the ranks that share this node's store root (node-local): the same host and path (the drills' simulated
    # nodes share a host, each with a root of its own; those of one launcher share one root)
    here = (socket.gethostname(), os.path.realpath(Path(store_dir) / job_id))
    ranks_here = {r for r, key in comm.all_gather_object((rank, here)) if key == here}
    if not drop:  # another node's sweep (every rank of a node drops, or none)
        return
    empty, remove = old_generation_share(store_dirs(store_dir, job_id), rank=rank, ranks_here=ranks_here,
                                         world_size=world_size)
    for d in remove:
        shutil.rmtree(d.config.directory, ignore_errors=True)
    for d in empty:
        d.open().discard_after(-1)
    for path in old_copy_dirs(Path(store_dir) / job_id / COPIES_DIRNAME, rank=rank, ranks_here=ranks_here):
        shutil.rmtree(path, ignore_errors=True)
    # upstream logs: only of numbers no rank here has. A rank's own log directory is open in its upstream
    # logging (an arena); what it holds of the old world is never read (a replay's range starts after the
    # window of its own snapshot store, emptied above, and each iteration is written anew before it is
    # read) and goes with the log's retention, but nothing would ever write or prune the others again
    for path in old_copy_dirs(upstream_root(Path(store_dir) / job_id), rank=rank, ranks_here=ranks_here, own=False):
        shutil.rmtree(path, ignore_errors=True)


def old_copy_dirs(root: Path, *, rank: int, ranks_here: set[int], own: bool = True) -> list[Path]:
    """Rank ``rank``'s share of the CheckFree+ copy directories ``root/rank<r>`` (``moe_ft/checkfree/copies.py``)
    of the previous generation: its own number's, and the lowest rank of the node those of numbers no rank here
    has (no rank writes them again). Copies are named by holder rank and iteration only, so new rank ``r``'s
    rebuild would otherwise take the old world's copy of an iteration it never copied (the old world's
    abandoned timeline, or another old rank's stage) where the copy is missing (CheckFree §4.3: the copy makes
    the rebuilt embedding / output layer exact). Each rank removes its own before it trains, so no rank here
    writes into a directory while it is removed. ``own=False``: only the lowest rank's share of numbers no rank
    here has (the upstream logs' ``root/rank<r>``, :func:`moe_ft.localized.component.log_root`)."""
    out = []
    for path in sorted(root.glob("rank*")):
        number = path.name[4:]
        if path.is_dir() and number.isdigit() and (
                (own and int(number) == rank) or (rank == min(ranks_here) and int(number) not in ranks_here)):
            out.append(path)
    return out


def write_report(decision, report_dir: str, section: dict, *, last_completed: int) -> None:
    """``<report_dir>/elastic_<generation>.json``: what changed, the point, the fetches, the cost."""
    out = {"kind": decision.kind, "generation": decision.generation, "notes": decision.notes,
           "reason": decision.reason, "world_size": decision.world_size, "ep_size": decision.ep_size,
           "previous_world_size": decision.previous.world_size if decision.previous else None,
           "point": decision.iteration, "resume": decision.iteration + 1 if decision.iteration >= 0 else None,
           "last_completed": last_completed,
           "lost_iterations": (list(range(decision.iteration + 1, last_completed + 1))
                               if decision.iteration >= 0 else []),
           "plans": {str(k): v for k, v in decision.plans.items()},
           "planned_expert_fetches": [[f.layer, f.expert_idx, f.dst, f.src] for f in decision.replan.fetches]
           if decision.replan else [], **section}
    path = Path(report_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"elastic_{decision.generation}.json").write_text(json.dumps(out, indent=1))
