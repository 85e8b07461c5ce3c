"""Elastic expert placement and the flexible token dispatcher (Lazarus; SPEC §6).

Planning (pure Python/NumPy): ``allocation`` (eq. 1), ``placement`` (MRO, spread, compact), ``recovery``
(exact recovery probability), ``search`` (the ``optimal`` strategy), ``migration`` (§4.3 node mapping and
transfers), ``planner`` (per-layer plans, reconfiguration), ``shortfall`` (MRO vs best study).
Dispatch arithmetic (PyTorch, no process groups): ``dispatch`` (interface), ``dispatch_schedule``
(Alg. 1 counts), ``dispatch_ref`` (reference permutation), ``dispatch_triton`` (kernels, explicit opt-in).
"""

from moe_ft.elastic.allocation import allocate_replicas
from moe_ft.elastic.placement import Plan, compact_plan, mro_plan, spread_plan
from moe_ft.elastic.planner import LayerPlan, PlacementConfig, plan_layer, plan_layers, reconfigure
from moe_ft.elastic.recovery import RecoveryConfig, RecoveryEstimate, recovery_probabilities
from moe_ft.elastic.search import SearchConfig, optimal_plan

__all__ = [
    "LayerPlan", "PlacementConfig", "Plan", "RecoveryConfig", "RecoveryEstimate", "SearchConfig",
    "allocate_replicas", "compact_plan", "mro_plan", "optimal_plan", "plan_layer", "plan_layers",
    "recovery_probabilities", "reconfigure", "spread_plan",
]
