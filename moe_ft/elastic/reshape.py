"""Re-planning the expert replicas when the world changes: shrink, grow, rebalance (Lazarus §4.3, §5).

A job that keeps training on fewer nodes (torchrun ``--nnodes MIN:MAX``: a lost node is not replaced) or
takes new nodes in restarts with another world size. This module is the arithmetic of that restart and of
the periodic rebalance, with no process group (every rank computes the same result from the same inputs):

1. :func:`rederive_expert_parallel` -- the EP size of the new world: kept when it still divides the ranks
   of a pipeline stage, else the largest divisor of them that is not larger, divides the number of experts
   (Megatron builds ``E / EP`` standard experts first) and still gives every expert a slot (``EP x c >= E``);
   the fault threshold ``f`` is lowered when ``EP x c < E x f``. Each change comes back as a line for the
   log; an impossible world raises ``ValueError`` naming the fix.
2. :func:`replan` -- given what each new EP rank already has (``held``: after a restart, what the node
   inventories of its data-parallel copies hold, ``moe_ft/elastic/restart.py``; a joining node has nothing),
   a new eq.-1 allocation and placement per MoE layer from the current popularity
   (``moe_ft.placement.layers.plan_layer``), then the greedy node mapping of ``migration.map_nodes`` (logical node of the
   new plan -> new EP rank, fewest experts fetched) and one :class:`Fetch` per (layer, EP rank, expert) the
   rank does not have, with its source: a surviving holder node (peer transfer, spread over the holders as
   ``migration.transfer_schedule`` does) or ``None`` when no surviving node has the expert at all. Such a
   layer cannot be served from live replicas: :attr:`Replan.lost` lists it and the caller falls back to the
   newest complete recovery point that has it (durable tier), with :attr:`Replan.reason` in the report.

For a rebalance inside a running job (``held`` = what each EP rank holds in memory) the same
:func:`replan` moves only what the new plan needs: an expert a rank keeps is never fetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from moe_ft.placement.allocation import held_fault_threshold
from moe_ft.placement.layers import ExpertPlacementConfig, plan_layer
from moe_ft.placement.migration import map_nodes, transfer_schedule


@dataclass(frozen=True)
class ParallelChange:
    """The expert-parallel size and fault threshold for a new world, and the log lines explaining them."""

    ep_size: int
    min_replicas: int
    notes: tuple[str, ...] = ()


def rederive_expert_parallel(world_size: int, *, tp: int, pp: int, ep: int, num_experts: int, slots: int,
                             min_replicas: int = 1) -> ParallelChange:
    """EP size and ``f`` for ``world_size`` ranks (see the module docstring). ``slots``: replica slots per
    EP rank (``c``; fixed: it is memory). Raises ``ValueError`` when no EP size fits."""
    if world_size < 1 or tp < 1 or pp < 1 or ep < 1 or slots < 1 or num_experts < 1:
        raise ValueError(f"sizes must be >= 1, got {world_size=} {tp=} {pp=} {ep=} {slots=} {num_experts=}")
    if world_size % (tp * pp):
        raise ValueError(f"{world_size} ranks cannot keep tensor x pipeline parallel size {tp} x {pp} = {tp * pp}: "
                         f"pipeline stages are not re-derived (their layers would move); restart with a "
                         f"multiple of {tp * pp} ranks (torchrun --nnodes MIN:MAX with MIN nodes covering it)")
    stage_ranks = world_size // (tp * pp)
    notes = []
    new_ep = ep
    if stage_ranks % ep:
        # E % d: Megatron builds the standard experts (E / EP per rank) before the elastic layer replaces them
        fits = [d for d in range(min(ep, stage_ranks), 0, -1)
                if stage_ranks % d == 0 and num_experts % d == 0 and d * slots >= num_experts]
        if not fits:
            # the slots that make the largest valid EP size fit: it must divide the stage's ranks and E too
            # (ceil(E / stage ranks) alone names slot counts no valid EP size can use)
            widest = max(d for d in range(1, min(ep, stage_ranks) + 1) if stage_ranks % d == 0 and num_experts % d == 0)
            raise ValueError(f"no expert-parallel size <= {ep} divides the {stage_ranks} ranks of a stage and holds "
                             f"{num_experts} experts in {slots} slots per rank; raise --ft-expert-slots to "
                             f"{num_experts // widest} (expert-parallel size {widest}) or restart on more nodes")
        new_ep = fits[0]
        notes.append(f"expert-model-parallel-size {ep} -> {new_ep}: {ep} does not divide the {stage_ranks} ranks "
                     f"of a pipeline stage in a world of {world_size}")
    elif ep * slots < num_experts:
        raise ValueError(f"{ep} EP ranks x {slots} slots cannot hold {num_experts} experts; raise --ft-expert-slots")
    f = held_fault_threshold(min_replicas, num_nodes=new_ep, slots_per_node=slots, num_experts=num_experts)
    if f < min_replicas:
        notes.append(f"fault threshold f {min_replicas} -> {f}: {new_ep} EP ranks x {slots} slots = "
                     f"{new_ep * slots} replicas cannot give {num_experts} experts {min_replicas} each")
    return ParallelChange(new_ep, f, tuple(notes))


@dataclass(frozen=True)
class UsableWorld:
    """The ranks that train in a world of ``world_size`` (the first ``usable``; the others wait as spares),
    and the expert-parallel change for it."""

    world_size: int
    usable: int
    change: ParallelChange

    @property
    def standby(self) -> list[int]:
        return list(range(self.usable, self.world_size))


def usable_world_size(world_size: int, *, tp: int, pp: int, ep: int, num_experts: int, slots: int,
                      global_batch: int, micro_batch: int, min_replicas: int = 1) -> UsableWorld:
    """The largest world ``U <= world_size`` that keeps the global batch: ``U`` a multiple of TP x PP whose
    data-parallel size ``d = U / (TP x PP)`` divides ``global_batch / micro_batch`` (each rank runs
    ``global_batch / (micro_batch x d)`` micro-batches; with PP > 1 at least PP of them) and for which
    :func:`rederive_expert_parallel` finds an EP size. The global batch is never changed: it is the
    optimisation's hyper-parameter (Lazarus §5 keeps it too), so a world that no data-parallel size fits
    trains on fewer ranks, and the ranks ``U … world_size - 1`` wait as spares. Raises ``ValueError`` when
    no world fits (the message says why the largest world a data-parallel size fits cannot hold the experts)."""
    if global_batch < 1 or micro_batch < 1 or global_batch % micro_batch:
        raise ValueError(f"--global-batch-size {global_batch} must be a positive multiple of --micro-batch-size "
                         f"{micro_batch}")
    micro_batches = global_batch // micro_batch
    reasons = []
    for usable in range(world_size - world_size % (tp * pp), 0, -tp * pp):
        dp = usable // (tp * pp)
        if micro_batches % dp or (pp > 1 and micro_batches // dp < pp):
            continue
        try:
            change = rederive_expert_parallel(usable, tp=tp, pp=pp, ep=ep, num_experts=num_experts, slots=slots,
                                              min_replicas=min_replicas)
        except ValueError as e:
            reasons.append(str(e))
            continue
        if usable < world_size:
            change = ParallelChange(change.ep_size, change.min_replicas, (
                f"world size {world_size} -> {usable}: the global batch of {global_batch} ({micro_batches} "
                f"micro-batches of {micro_batch}) splits over {dp} data-parallel ranks but not over "
                f"{world_size // (tp * pp)}; rank{'s' if world_size - usable > 1 else ''} "
                f"{', '.join(map(str, range(usable, world_size)))} wait as spares", *change.notes))
        return UsableWorld(world_size, usable, change)
    raise ValueError(f"no world of at most {world_size} ranks keeps the global batch of {global_batch} "
                     f"({micro_batches} micro-batches of {micro_batch}) with tensor x pipeline parallel size "
                     f"{tp} x {pp}" + (f" ({reasons[0]})" if reasons else "") + "; restart on more nodes")


@dataclass(frozen=True)
class Fetch:
    """New EP rank ``dst`` needs ``expert_idx`` of ``layer``; ``src``: the EP rank (in ``held``'s numbering)
    that serves it, ``None`` when no holder survives (recovery point needed)."""

    layer: int
    expert_idx: int
    dst: int
    src: int | None


@dataclass
class Replan:
    """New ``R[e][j]`` per layer, the fetches to get there, and the layers whose experts have no copy left."""

    replicas: dict[int, list[list[int]]]
    fetches: list[Fetch] = field(default_factory=list)
    lost: dict[int, list[int]] = field(default_factory=dict)
    """``{layer: experts}`` with no surviving copy on any node: the caller needs a recovery point for them."""

    @property
    def reason(self) -> str:
        """Why live replicas cannot serve this change ('' when they can): the recovery report's text."""
        if not self.lost:
            return ""
        parts = [f"layer {layer} experts {experts}" for layer, experts in sorted(self.lost.items())]
        return ("no surviving copy of " + "; ".join(parts) + ": every node holding them was lost; falling back "
                "to the newest complete recovery point that has them")


def replica_rows(plan, num_experts: int) -> list[list[int]]:
    """``R[e][j]`` (lists) from a plan with one tuple of experts per EP rank."""
    rows = [[0] * len(plan) for _ in range(num_experts)]
    for j, node in enumerate(plan):
        for e in node:
            rows[e][j] += 1
    return rows


def replan(held: Mapping[int, Mapping[int, set[int]]], loads: Mapping[int, Sequence[float]], *, ep_size: int,
           config: ExpertPlacementConfig) -> Replan:
    """Re-plan every layer for ``ep_size`` EP ranks (see the module docstring).

    ``held[layer][j]``: experts EP rank ``j`` (``0 <= j < ep_size``) has without a transfer; ``loads[layer]``:
    tokens per expert (current popularity; eq. 1 needs them non-negative).
    """
    if sorted(held) != sorted(loads):
        raise ValueError(f"layers of held experts {sorted(held)} and of loads {sorted(loads)} differ")
    out = Replan(replicas={})
    for layer in sorted(loads):
        layer_held = {j: tuple(sorted(held[layer].get(j, ()))) for j in range(ep_size)}
        num_experts = len(loads[layer])
        new = plan_layer(loads[layer], ep_size, config)
        logical_to_rank = map_nodes(layer_held, new.plan, num_experts)
        plan = [()] * ep_size
        for logical, rank in enumerate(logical_to_rank):
            plan[rank] = new.plan[logical]
        out.replicas[layer] = replica_rows(plan, num_experts)
        survivors = {e for experts in layer_held.values() for e in experts}
        missing = sorted(set(range(num_experts)) - survivors)
        if missing:
            out.lost[layer] = missing
        wanted = [tuple(e for e in plan[j] if e in survivors) for j in range(ep_size)]
        for t in transfer_schedule(layer_held, wanted, list(range(ep_size))):
            out.fetches.append(Fetch(layer, t.expert_idx, t.dst, t.src))
        out.fetches += [Fetch(layer, e, j, None) for j in range(ep_size) for e in sorted(set(plan[j]))
                        if e in missing]
    return out
