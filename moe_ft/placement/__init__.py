"""Expert placement: how many replicas each expert gets and which node holds them (Lazarus §4.1, §4.3).

Pure Python/NumPy, no process groups: ``allocation`` (eq. 1), ``plans`` (MRO, spread, compact),
``reliability`` (exact recovery probability of a plan), ``search`` (the ``optimal`` strategy),
``migration`` (§4.3 node mapping and transfers), ``layers`` (per-layer plans, reconfiguration), ``loads``
(expert loads measured by an earlier run). The elastic runtime (``moe_ft.elastic``) and the flexible
dispatcher (``moe_ft.megatron_ext.dispatch``) use these plans.
"""

from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.layers import ExpertPlacementConfig, LayerPlan, plan_layer, plan_layers, reconfigure
from moe_ft.placement.plans import Plan, compact_plan, mro_plan, spread_plan
from moe_ft.placement.reliability import RecoveryEstimate, ReliabilityConfig, recovery_probabilities
from moe_ft.placement.search import SearchConfig, optimal_plan

__all__ = [
    "ExpertPlacementConfig", "LayerPlan", "Plan", "RecoveryEstimate", "ReliabilityConfig", "SearchConfig",
    "allocate_replicas", "compact_plan", "mro_plan", "optimal_plan", "plan_layer", "plan_layers",
    "recovery_probabilities", "reconfigure", "spread_plan",
]
