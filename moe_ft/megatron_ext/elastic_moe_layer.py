"""``MoELayer`` with the flexible dispatcher and replicated experts (Lazarus §4.2).

Megatron picks the token dispatcher with a string switch inside ``MoELayer.__init__``; this subclass
lets the parent build its standard alltoall dispatcher and standard-EP experts (so the RNG stream and every
non-expert parameter are exactly those of a standard run), then replaces the two at that one place:
``ElasticTokenDispatcher`` and ``ElasticExperts`` initialised from the standard experts. Selected by
``--moe-token-dispatcher-type flexible``; the replica map comes from ``ElasticConfig``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec

from moe_ft.megatron_ext.dispatch.arithmetic import FLEXIBLE, DispatchConfig, check_flexible_model
from moe_ft.megatron_ext.dispatch.dispatcher import ElasticTokenDispatcher
from moe_ft.megatron_ext.elastic_experts import ElasticExperts

if TYPE_CHECKING:
    from moe_ft.elastic.config import ElasticConfig


class ElasticMoELayer(MoELayer):
    """``MoELayer`` whose experts are the replicas ``elastic.replica_map(E, EP, layer)`` puts on this EP
    rank; with any other ``moe_token_dispatcher_type`` it is exactly ``MoELayer``. With per-layer plans the
    replacement happens in ``set_layer_number`` (the layer index is not known earlier); ``replicas`` is this
    layer's ``R[e, j]`` once built."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 elastic: ElasticConfig):
        if config.moe_token_dispatcher_type != FLEXIBLE:  # Megatron's own dispatchers: plain MoELayer
            if elastic.enabled:
                raise ValueError(f"--ft-expert-replicas needs --moe-token-dispatcher-type {FLEXIBLE}, got "
                                 f"{config.moe_token_dispatcher_type!r}")
            super().__init__(config, submodules, layer_number, pg_collection)
            return
        experts_spec = submodules.experts
        # refused at parsing (ElasticConfig.check_args); a layer built from another spec is checked here
        check_flexible_model(sequential_experts=isinstance(experts_spec, ModuleSpec)
                             and issubclass(experts_spec.module, SequentialMLP))
        if config.moe_shared_expert_overlap:
            raise ValueError("the flexible dispatcher does not overlap shared experts; unset "
                             "moe_shared_expert_overlap")
        standard = copy.copy(config)
        standard.moe_token_dispatcher_type = "alltoall"  # what the parent's switch builds (then replaced)
        super().__init__(standard, submodules, layer_number, pg_collection)
        self.config = config
        if pg_collection is None:
            pg_collection = get_default_pg_collection()  # what the parent used
        self._elastic, self._pg_collection, self._experts_spec = elastic, pg_collection, experts_spec
        self.replicas = None  # R[e, j] of this layer once built
        # loads measured per layer: the plan needs the layer index, which TransformerLayer passes through
        # set_layer_number right after construction
        if not elastic.per_layer or layer_number is not None:
            self._build_elastic(layer_number)

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        if self.config.moe_token_dispatcher_type == FLEXIBLE and self.replicas is None:
            self._build_elastic(layer_number)

    def _build_elastic(self, layer_number: int | None) -> None:
        """Replace the standard dispatcher/experts with this layer's plan (collective over the EP group)."""
        config, pg_collection, elastic = self.config, self._pg_collection, self._elastic
        layer_idx = None if layer_number is None else int(layer_number) - 1  # as the popularity counters
        replicas = elastic.replica_map(config.num_moe_experts, self.ep_group.size(), layer_idx)
        self.token_dispatcher = ElasticTokenDispatcher(
            replicas, config, pg_collection, DispatchConfig(backend=elastic.ft_dispatch_backend))
        no_init = copy.copy(config)
        no_init.perform_initialization = False  # weights come from the standard experts, not new RNG draws
        # in-run rebalancing (--ft-rebalance-interval): one MLP per slot, so a plan with more distinct experts
        # on this rank fits without new parameters (the optimizer and DDP stay as built)
        num_slots = int(replicas.sum(0)[0]) if elastic.ft_rebalance_interval > 0 else None
        experts = ElasticExperts(no_init, self._experts_spec.submodules, pg_collection, replicas=replicas,
                                 num_slots=num_slots)
        experts.copy_from_standard(self.experts)
        self.experts = experts
        self.replicas = replicas

    def set_plan(self, replicas, mlp_of: dict[int, int]) -> None:
        """Serve ``replicas`` from the next forward on, expert ``e`` by MLP ``mlp_of[e]`` (state already moved:
        ``moe_ft/elastic/live.py``)."""
        self.experts.set_plan(replicas, mlp_of)
        self.token_dispatcher.set_replicas(replicas)
        self.replicas = replicas

    def forward(self, *args, **kwargs):
        if self.config.moe_token_dispatcher_type == FLEXIBLE and self.replicas is None:
            raise RuntimeError("ElasticMoELayer with per-layer plans was used before set_layer_number(); "
                               "build it inside a TransformerLayer or pass layer_number")
        return super().forward(*args, **kwargs)

def elastic_mlp_spec(mlp_spec: ModuleSpec, elastic: ElasticConfig) -> ModuleSpec:
    """Megatron's MoE ``ModuleSpec`` with ``ElasticMoELayer`` in place of ``MoELayer`` (same submodules)."""
    if not (isinstance(mlp_spec, ModuleSpec) and issubclass(mlp_spec.module, MoELayer)):
        raise ValueError(f"expected an MoELayer spec for the MLP, got {mlp_spec!r}")
    if not issubclass(ElasticMoELayer, mlp_spec.module):
        raise ValueError(f"the MLP spec uses {mlp_spec.module.__name__}; the elastic layer subclasses MoELayer "
                         "only and cannot also apply that subclass")
    params = {**(mlp_spec.params or {}), "elastic": elastic}
    return ModuleSpec(module=ElasticMoELayer, submodules=mlp_spec.submodules, params=params)
