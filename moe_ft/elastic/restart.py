"""Keep training on the world torchrun gives after a restart (``--ft-elastic``; Lazarus §4.3, §5).

Under ``torchrun --nnodes MIN:MAX`` a lost node need not be replaced: the rendezvous closes with the nodes
that are left (shrink), and a node that comes back or joins later makes the agents restart the workers on
the larger world (grow). The restarted job decides, at model build (collective over the coordination group,
:func:`decide`), which replica plan every elastic MoE layer gets:

* ``fresh``   no layout record anywhere (first start): the plan of the flags (``ElasticConfig``);
* ``same``    the newest record has this world and EP size: that record's plans (a rank or a node was
              replaced; the stores match them; the usual recovery runs);
* ``reshape`` the world or EP size changed: the newest iteration ``T`` at which every operator has a FULL
              copy on some surviving node with the metadata (``LayoutInventory``: survivor points -- the survivors'
              exact state at their last completed iteration --, dense snapshots, or the replicas a node holds
              for its peers; with the distributed optimizer the copies' ranges must cover every element of
              every sharded parameter together) is agreed; each new EP rank
              *has* the experts the nodes of its data-parallel copies hold at ``T`` (a copy on another node
              serves the others over the network); eq. 1 re-allocates from the cumulative loads
              of the newest record and :func:`moe_ft.elastic.reshape.replan` places and maps with the fewest
              fetches. ``restore.py`` then loads every operator at ``T`` (node-local, else from a peer) and
              training resumes at ``T + 1``.
* ``fallback`` the world changed but no such ``T`` exists (an expert lost every copy, or only sparse points
              without a survivor point): the reason is kept for the report and recovery falls back to the
              newest complete recovery point the usual way (durable tier, ``--load``), never silently.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.elastic.inventory import LayoutRecord, Ranges, newest_record, node_inventory, read_records
from moe_ft.elastic.reshape import Replan, rederive_expert_parallel, replan
from moe_ft.placement.layers import ExpertPlacementConfig
from moe_ft.state import shards
from moe_ft.state.operators import OperatorId


@dataclass
class RestartDecision:
    """What :func:`decide` agreed on; the same on every rank."""

    kind: str
    """``fresh``, ``same``, ``reshape`` or ``fallback`` (module docstring)."""
    generation: int
    previous: LayoutRecord | None = None
    plans: dict[int, list[list[int]]] = field(default_factory=dict)
    """``{layer_idx: R[e][j]}`` to build (empty: the flags' plan)."""
    iteration: int = -1
    """``T``: the point every operator is restored from (``reshape``)."""
    notes: list[str] = field(default_factory=list)
    replan: Replan | None = None
    reason: str = ""
    """Why live copies cannot serve the change (``fallback``)."""
    world_size: int = 0
    ep_size: int = 0
    ranks: list[dict] = field(default_factory=list)
    """Every rank's ``rank``, ``node``, ``ep_rank`` and node inventory summary (from the all-gather)."""
    behind: list[int] = field(default_factory=list)
    """Ranks on a node whose layout records are all of a generation before :attr:`previous`'s: the node ran no
    rank of that generation (it waited as a spare, ``standby.py``), so what its stores hold is an older
    generation's (another plan, other rank numbers, perhaps a timeline the job left). Its points are not counted
    here, and the node drops them before anything reads them (``restore.discard_if_behind``)."""


def required_operators(num_layers: int, num_experts: int) -> set[OperatorId]:
    """Every operator of the model (with pipeline parallelism the union of the stages')."""
    ops = {OperatorId.embedding(), OperatorId.output()}
    for layer in range(num_layers):
        ops |= {OperatorId.dense(layer), OperatorId.gate(layer)}
        ops |= {OperatorId.expert_op(layer, e) for e in range(num_experts)}
    return ops


def newest_complete_point(inventories: dict[int, dict[int, Mapping[str, list[Ranges]] | list[str]]],
                          required: set[OperatorId], sharded: Mapping[str, Mapping[str, int]] | None = None
                          ) -> tuple[int, str]:
    """``(T, '')``: the newest iteration at which the nodes together hold every required operator at FULL
    (and some node its metadata), or ``(-1, reason)`` naming what is missing at the newest point.

    ``inventories``: ``{node: {iteration: {operator: [ranges of each copy]}}}`` (``LayoutInventory.summary``;
    a list of names stands for whole copies). With the distributed optimizer an operator is whole only when
    the union of its copies' ranges covers every element of every sharded parameter: those of ``sharded``
    (``{operator: {param: numel}}``, the layout records') and any a copy names."""
    names = {str(op) for op in required}
    iterations = sorted({it for inv in inventories.values() for it in inv}, reverse=True)
    if not iterations:
        return -1, "no node kept a point with metadata (stores lost, or nothing was published yet)"
    lacking = {it: _lacking(it, inventories, names, sharded or {}) for it in iterations}
    complete = [it for it in iterations if not lacking[it]]
    if complete:
        return complete[0], ""
    missing = lacking[iterations[0]]
    return -1, (f"no point has every operator at FULL on the surviving nodes (newest point {iterations[0]} lacks "
                f"{len(missing)}: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}); a sparse point "
                f"needs a survivor point or a window replay on the old world, an expert whose every holder "
                f"was lost needs the durable tier, and with the distributed optimizer a lost rank's shards need "
                f"its replicas of a dense point (--ft-policy dense with --ft-replicas)")


def _lacking(it: int, inventories, names: set[str], sharded: Mapping[str, Mapping[str, int]]) -> list[str]:
    """What point ``it`` lacks over all nodes: operators without a FULL copy, then operators whose copies
    miss optimizer elements (with the reason)."""
    copies: dict[str, list[Ranges]] = {}
    for inv in inventories.values():
        held = inv.get(it, {})
        for op in held:
            copies.setdefault(op, []).extend(held[op] if isinstance(held, Mapping) else [{}])
    gaps = {op: _missing(op, copies[op], sharded) for op in sorted(names & set(copies))}
    return sorted(names - set(copies)) + [f"{op} ({gap})" for op, gap in gaps.items() if gap]


def _missing(op: str, copies: list[Ranges], sharded: Mapping[str, Mapping[str, int]]) -> str:
    """Which elements of ``op``'s sharded optimizer state no copy holds (``''``: none missing)."""
    params = dict(sharded.get(op, {}))
    for ranges in copies:
        for param, (_, _, numel) in ranges.items():
            params.setdefault(param, numel)
    if not params:
        return ""  # whole copies (the plain optimizer)
    lost = shards.missing_elements(copies, params)
    if not lost:
        return ""
    param, ((s, e), *_) = next(iter(lost.items()))
    more = f" and of {len(lost) - 1} more parameters" if len(lost) > 1 else ""
    return f"optimizer state elements {s}:{e} of {param}{more}"


def ranks_behind(gathered: list[dict], generation: int) -> list[int]:
    """The ranks (``gathered``: each rank's ``rank`` and its node's layout ``records``) whose node kept records,
    all of a generation before ``generation``: it ran no rank of that generation (:attr:`RestartDecision.behind`).
    A node without records (a new one, or a first start) holds nothing of the job. Pure."""
    return sorted(g["rank"] for g in gathered
                  if g["records"] and max(r["generation"] for r in g["records"]) < generation)


def stage_of_layers(first_layers: dict[int, int], layers) -> dict[int, int]:
    """``{layer: pipeline stage}`` from the first MoE layer each stage builds (``first_layers``: stage ->
    layer; one model chunk per rank): a layer belongs to the stage with the largest first layer not above it."""
    starts = sorted((first, stage) for stage, first in first_layers.items())
    out = {}
    for layer in layers:
        owners = [stage for first, stage in starts if first <= layer]
        if not owners:
            raise ValueError(f"MoE layer {layer} lies before every stage's first MoE layer {first_layers}")
        out[layer] = owners[-1]
    return out


def decide(*, store_dir: str, job_id: str, num_layers: int, num_experts: int, ep_size: int, slots: int,
           min_replicas: int, strategy: str, pipeline_size: int = 1,
           first_layer: int | None = None) -> RestartDecision:
    """Collective: the plan of this start (see the module docstring). ``first_layer``: the first MoE layer
    this rank builds (with pipeline parallelism it places each layer's experts within its stage)."""

    comm.init_coordination()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mine = read_records(store_dir, job_id)  # every record of the node: stages record their own layers
    inventory = node_inventory(store_dir, job_id, prefer_rank=rank).summary() if mine else {}
    entry = {"rank": rank, "node": rank // local_world, "ep_rank": ps.get_expert_model_parallel_rank(),
             "pp_rank": ps.get_pipeline_model_parallel_rank(), "first_layer": first_layer,
             "records": [asdict(r) for r in mine], "inventory": inventory}
    gathered = comm.all_gather_object(entry)
    records = [LayoutRecord.from_dict(r) for g in gathered for r in g["records"]]
    previous = newest_record(records)
    ranks = [{k: g[k] for k in ("rank", "node", "ep_rank", "pp_rank")} for g in gathered]
    if previous is None:
        return RestartDecision("fresh", 0, world_size=world, ep_size=ep_size, ranks=ranks)
    behind = ranks_behind(gathered, previous.generation)
    if (previous.world_size, previous.ep_size) == (world, ep_size):
        return RestartDecision("same", previous.generation, previous, dict(previous.plans), world_size=world,
                               ep_size=ep_size, ranks=ranks, behind=behind)
    generation = previous.generation + 1
    notes = [f"world {previous.world_size} -> {world} ranks (EP {previous.ep_size} -> {ep_size})"]
    inventories = {g["node"]: {int(k): v for k, v in g["inventory"].items()} if g["rank"] not in behind else {}
                   for g in gathered}
    point, reason = newest_complete_point(inventories, required_operators(num_layers, num_experts),
                                          previous.sharded)
    if point < 0:
        return RestartDecision("fallback", generation, previous, notes=notes, reason=reason, world_size=world,
                               ep_size=ep_size, ranks=ranks, behind=behind)
    change = rederive_expert_parallel(world, tp=1, pp=pipeline_size, ep=ep_size, num_experts=num_experts,
                                      slots=slots, min_replicas=min_replicas)
    notes += list(change.notes)
    held: dict[int, dict[int, set[int]]] = {}
    firsts = {g["pp_rank"]: g["first_layer"] for g in gathered if g["first_layer"] is not None}
    stage = stage_of_layers(firsts, previous.plans) if pipeline_size > 1 else dict.fromkeys(previous.plans, 0)
    for layer in previous.plans:
        per_ep: dict[int, set[int]] = {}
        for g in ranks:
            if g["pp_rank"] != stage[layer]:  # an EP rank of another stage does not build this layer
                continue
            on_node = {int(name.split(".E")[1]) for name in inventories[g["node"]].get(point, ())
                       if name.startswith(f"expert.L{layer}.E")}
            per_ep[g["ep_rank"]] = per_ep.get(g["ep_rank"], set()) | on_node
        held[layer] = per_ep
    loads = {layer: [float(x) for x in previous.loads.get(layer, [1.0] * num_experts)] for layer in previous.plans}
    out = replan(held, loads, ep_size=ep_size,
                 config=ExpertPlacementConfig(slots_per_node=slots, min_replicas=change.min_replicas, strategy=strategy))
    return RestartDecision("reshape", generation, previous, out.replicas, point, notes, out, world_size=world,
                           ep_size=ep_size, ranks=ranks, behind=behind)
