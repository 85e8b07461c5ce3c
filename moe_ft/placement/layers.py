"""Per-layer allocation + placement and reconfiguration (Lazarus §4.1 last paragraph, §4.3).

Loads differ across MoE layers, so every layer gets its own allocation and plan. ``reconfigure`` turns the
current per-layer plans (on physical node ids) and fresh loads into new plans for the nodes that will run
next -- after failures, joins, or a periodic rebalance -- together with the node mapping and the
transfers for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.migration import ExpertTransfer, map_nodes, transfer_schedule
from moe_ft.placement.plans import STRATEGIES_BASELINE, Plan
from moe_ft.placement.search import SearchConfig, optimal_plan

STRATEGIES = ("optimal", "mro", "spread", "compact")


@dataclass(kw_only=True, frozen=True)
class ExpertPlacementConfig:
    """Allocation and placement of one MoE layer's experts over the nodes."""

    slots_per_node: int
    """``c``: expert replicas one node holds (summed over its GPUs)."""
    min_replicas: int = 1
    """``f``: every expert gets at least this many replicas, so any ``f - 1`` failed nodes are survivable."""
    strategy: str = "optimal"
    """One of ``optimal`` (default; never worse than MRO), ``mro``, ``spread``, ``compact``."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Budgets and objective of ``optimal``."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown placement strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class LayerPlan:
    """``allocation[e]``: replicas of expert ``e``; ``plan[n]``: experts on logical node ``n``."""

    allocation: tuple[int, ...]
    plan: Plan


def place(replicas: Sequence[int], num_nodes: int, config: ExpertPlacementConfig) -> Plan:
    """Plan for a given allocation with ``config.strategy``."""
    if config.strategy == "optimal":
        return optimal_plan(replicas, num_nodes, config.slots_per_node, config.search).plan
    return STRATEGIES_BASELINE[config.strategy](replicas, num_nodes, config.slots_per_node)


def plan_layer(loads: Sequence[float], num_nodes: int, config: ExpertPlacementConfig) -> LayerPlan:
    """Eq. 1 allocation from ``loads`` (tokens per expert), then placement."""
    replicas = allocate_replicas(
        loads, num_nodes=num_nodes, slots_per_node=config.slots_per_node, min_replicas=config.min_replicas
    )
    return LayerPlan(tuple(replicas), place(replicas, num_nodes, config))


def plan_layers(loads_per_layer: Sequence[Sequence[float]], num_nodes: int, config: ExpertPlacementConfig) -> list[LayerPlan]:
    """One independent ``LayerPlan`` per MoE layer."""
    return [plan_layer(loads, num_nodes, config) for loads in loads_per_layer]


@dataclass(frozen=True)
class LayerReconfiguration:
    """New plan of one layer, ``physical[n]``: physical node id running logical node ``n``, and transfers."""

    layer: LayerPlan
    physical: tuple[int, ...]
    transfers: tuple[ExpertTransfer, ...]


def reconfigure(
    current: Sequence[dict[int, Sequence[int]]],
    loads_per_layer: Sequence[Sequence[float]],
    nodes: Sequence[int],
    config: ExpertPlacementConfig,
) -> list[LayerReconfiguration]:
    """Re-plan every layer for the physical ``nodes`` that will run next (§4.3).

    ``current[layer]``: physical node id -> experts it holds in that layer (failed nodes simply absent;
    nodes in ``nodes`` but not in ``current`` are new and hold nothing). Raises ``RuntimeError`` when an
    expert lost every replica.
    """
    if len(current) != len(loads_per_layer):
        raise ValueError(f"{len(current)} layers of placements but {len(loads_per_layer)} layers of loads")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"node ids must be distinct, got {list(nodes)}")
    out = []
    for held_all, loads in zip(current, loads_per_layer):
        held = {p: tuple(held_all.get(p, ())) for p in nodes}
        layer = plan_layer(loads, len(nodes), config)
        physical = map_nodes(held, layer.plan, len(loads))
        transfers = transfer_schedule(held, layer.plan, physical)
        out.append(LayerReconfiguration(layer, tuple(physical), tuple(transfers)))
    return out
