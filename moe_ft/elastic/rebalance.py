"""Rebalancing expert replicas inside a running job: the plan (Lazarus §4.3, §5).

Loads drift during training; Lazarus re-allocates replicas (eq. 1) from the loads measured since the last
plan and re-places them, moving as little state as possible ("periodic rebalancing as loads drift").
Inside a live job nothing was lost, so every expert has a holder: a rebalance is :func:`reshape.replan` with
``held`` = what each EP rank holds in memory now (:func:`held_from_replicas`). The greedy node mapping keeps
every replica a rank already has; only an expert that a rank gains is fetched, from a current holder (the
fetches spread over the holders, §4.3). A layer whose eq.-1 replica counts did not change keeps its plan
as it is (nothing moves).

Arithmetic only (no process group): :func:`plan_rebalance` gives the new ``R[e][j]`` per layer, the
fetches, and per EP rank the experts it keeps, gains and drops; every rank computes the same result from
the same (all-reduced) loads. ``live.py`` executes a plan on the running model (the state moves) and
``rebalance_component.py`` decides when.

Exactness: all replicas of an expert hold identical state (``ElasticExperts``: broadcast at build, gradients
summed over the holders before the optimizer step), so it does not matter which holder sends. What a
rebalance does change is which replica serves which tokens; see docs/elastic.md "Rebalancing in a run".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from moe_ft.elastic.reshape import Fetch, replan
from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.layers import ExpertPlacementConfig

ExpertKey = tuple[int, int]
"""``(layer, expert_idx)``."""


def held_from_replicas(replicas: Mapping[int, Sequence[Sequence[int]]]) -> dict[int, dict[int, set[int]]]:
    """``{layer: {EP rank j: distinct experts with R[e][j] > 0}}`` from ``{layer: R[e][j]}``."""
    out: dict[int, dict[int, set[int]]] = {}
    for layer, rows in replicas.items():
        ep_size = len(rows[0])
        out[layer] = {j: {e for e, row in enumerate(rows) if row[j] > 0} for j in range(ep_size)}
    return out


@dataclass
class RebalancePlan:
    """What one rebalance changes (identical on every rank)."""

    old: dict[int, list[list[int]]]
    new: dict[int, list[list[int]]]
    fetches: list[Fetch] = field(default_factory=list)
    """One per (layer, expert, EP rank that gains it); ``src``: the EP rank that sends it."""

    def held(self, ep_rank: int, *, after: bool) -> set[ExpertKey]:
        rows_by_layer = self.new if after else self.old
        return {(layer, e) for layer, rows in rows_by_layer.items() for e, row in enumerate(rows) if row[ep_rank] > 0}

    def gains(self, ep_rank: int) -> set[ExpertKey]:
        return self.held(ep_rank, after=True) - self.held(ep_rank, after=False)

    def drops(self, ep_rank: int) -> set[ExpertKey]:
        return self.held(ep_rank, after=False) - self.held(ep_rank, after=True)

    @property
    def changed(self) -> bool:
        """Whether any replica count or any rank's expert set differs (a new ``R`` with the same sets still
        changes the dispatch shares)."""
        return self.old != self.new

    def replica_counts(self) -> dict[int, list[int]]:
        """``{layer: replicas per expert}`` of the new plan (the log line)."""
        return {layer: [sum(row) for row in rows] for layer, rows in self.new.items()}


def plan_rebalance(replicas: Mapping[int, Sequence[Sequence[int]]], loads: Mapping[int, Sequence[float]], *,
                   config: ExpertPlacementConfig) -> RebalancePlan:
    """New plans from ``loads`` (tokens per expert since the last plan, per layer) for the EP ranks of
    ``replicas`` (the current ``R[e][j]`` per layer). Raises ``ValueError`` on inconsistent inputs."""
    if sorted(replicas) != sorted(loads):
        raise ValueError(f"layers of the current plans {sorted(replicas)} and of the loads {sorted(loads)} differ")
    sizes = {len(rows[0]) for rows in replicas.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layer's plan must cover the same EP ranks, got sizes {sorted(sizes)}")
    for layer, rows in replicas.items():
        if len(loads[layer]) != len(rows):
            raise ValueError(f"layer {layer}: {len(loads[layer])} loads for {len(rows)} experts")
        per_rank = [sum(col) for col in zip(*rows)]
        if any(n != config.slots_per_node for n in per_rank):
            raise ValueError(f"layer {layer}: the current plan fills {per_rank} slots per EP rank but the placement "
                             f"has {config.slots_per_node}; pass the --ft-expert-slots the plan was made with")
        if any(sum(row) == 0 for row in rows):
            raise ValueError(f"layer {layer}: the current plan {rows} leaves an expert without a replica")
    ep_size = sizes.pop()
    old = {layer: [list(row) for row in rows] for layer, rows in replicas.items()}
    # a layer whose eq.-1 counts did not change keeps its placement: re-placing the same counts would move
    # bytes for no change in the dispatch shares
    counts = {layer: allocate_replicas(list(loads[layer]), num_nodes=ep_size, slots_per_node=config.slots_per_node,
                                       min_replicas=config.min_replicas) for layer in replicas}
    moving = sorted(layer for layer in replicas if counts[layer] != [sum(row) for row in old[layer]])
    out = replan({layer: held_from_replicas(replicas)[layer] for layer in moving},
                 {layer: loads[layer] for layer in moving}, ep_size=ep_size, config=config)
    assert not out.lost, "a live plan holds every expert somewhere"
    new = {layer: out.replicas.get(layer, old[layer]) for layer in sorted(replicas)}
    return RebalancePlan(old=old, new=new, fetches=list(out.fetches))
