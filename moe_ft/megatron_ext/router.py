"""A ``TopKRouter`` that reports every training micro-batch's routing to the popularity counters
(MoEvement §3.5 activation counts ``A_j^l``, App. B soft counts; MoEtion §4.3; MoC §3.2).

Installed through the layer spec (:func:`install_router`); the counters are attached after the model is
built (:func:`attach_popularity`), so the spec holds no runtime object and nothing is global. Without an
attached counter the router behaves exactly like Megatron's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from moe_ft.popularity import move_buffer


def per_expert_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, *, topk: int,
                              capacity_factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token dropping with one capacity factor per expert (Megatron's ``apply_router_token_dropping``
    with ``drop_policy="probs"`` uses one factor for all). Expert ``e`` keeps its
    ``ceil(num_tokens * topk / num_experts * capacity_factors[e])`` highest-probability tokens.

    ``probs``, ``routing_map``: ``[num_tokens, num_experts]``; ``capacity_factors``: ``[num_experts]``.
    Returns the masked ``(probs, routing_map)``."""
    num_tokens, num_experts = probs.shape
    # built on the host (factors are host floats) and sent without a sync: a pageable host-to-device copy
    # with non_blocking is staged at once, it does not wait for the device
    capacity = torch.tensor([math.ceil(num_tokens * topk / num_experts * float(f)) for f in capacity_factors],
                            dtype=torch.long).to(probs.device, non_blocking=True)
    # rank of every token within its expert's column by probability (0 = highest); unselected
    # (token, expert) pairs are never kept, so they are ranked after every selected one
    key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0, dtype=probs.dtype))
    order = torch.argsort(key, dim=0, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(num_tokens, device=probs.device).unsqueeze(1).expand_as(order))
    final_map = routing_map & (rank < capacity.unsqueeze(0))
    return probs * final_map, final_map


@dataclass(kw_only=True)
class CapacityBoostConfig:
    """MoEtion §6: after a lossy recovery, experts restored from a stale FULL entry take more capacity
    until the tokens they lost are made up."""

    capacity_factor: float
    """Base capacity factor of every expert: Megatron's ``--moe-expert-capacity-factor`` (the router then
    does the dropping in place of Megatron's, :meth:`PopularityRouter.take_over_token_dropping`)."""
    boost: float = 0.10
    """Extra capacity of a stale expert (MoEtion: "process 10 % more tokens")."""

    def __post_init__(self) -> None:
        if self.capacity_factor <= 0 or self.boost < 0:
            raise ValueError(f"CapacityBoostConfig needs capacity_factor > 0 and boost >= 0, got {self}")


class CapacityBoost:
    """Per ``(moe layer, expert)`` the tokens still to make up. While positive, the expert's capacity
    factor is ``capacity_factor * (1 + boost)``; every token it keeps beyond the base capacity pays one
    token off (the boosted capacity is where lost tokens are made up). State on the object, attached to
    the routers like the popularity counters (:func:`attach_capacity_boost`).

    Tensors, all ``[num_moe_layers, num_experts]``: ``deficit`` (float64, tokens still to make up),
    ``owed`` (float64, the tokens handed over by :meth:`start` so far) and ``made_up_at`` (int64, the
    iteration in which the deficit reached zero; -1 while it is positive or was never started). The extra
    tokens of the open iteration accumulate on the routing tensors' device (no host sync per micro-batch)
    and are read back once in :meth:`end_iteration`."""

    def __init__(self, config: CapacityBoostConfig, *, moe_layers: list[int], num_experts: int,
                 all_reduce: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self.config, self.moe_layers, self.all_reduce = config, list(moe_layers), all_reduce
        self.deficit = torch.zeros(len(self.moe_layers), num_experts, dtype=torch.float64)
        self.owed = torch.zeros_like(self.deficit)
        self.made_up_at = torch.full(self.deficit.shape, -1, dtype=torch.int64)
        self._extra = torch.zeros_like(self.deficit)

    def start(self, lost_tokens: torch.Tensor) -> None:
        """After a lossy recovery: ``lost_tokens`` ``[num_moe_layers, num_experts]`` (the report's
        ``per_expert``) are added to the deficit to make up."""
        lost = lost_tokens.to(torch.float64).clamp(min=0)
        self.deficit += lost
        self.owed += lost
        self.made_up_at[lost > 0] = -1

    def capacity_factors(self, layer_idx: int) -> torch.Tensor:
        """``[num_experts]`` capacity factors of ``layer_idx`` (global 0-based layer index)."""
        stale = self.deficit[self.moe_layers.index(layer_idx)] > 0
        return self.config.capacity_factor * (1.0 + self.config.boost * stale.to(torch.float64))

    def record(self, layer_idx: int, routing_map: torch.Tensor, topk: int) -> None:
        """Count the tokens each expert kept beyond its base capacity in one micro-batch."""
        num_tokens, num_experts = routing_map.shape
        base = math.ceil(num_tokens * topk / num_experts * self.config.capacity_factor)
        kept = routing_map.sum(dim=0).to(torch.float64)
        if self._extra.device != kept.device:
            self._extra = move_buffer(self._extra, kept.device)
        self._extra[self.moe_layers.index(layer_idx)] += (kept - base).clamp(min=0)

    def end_iteration(self, iteration: int = -1) -> list[tuple[int, int]]:
        """Pay the iteration's extra tokens off the deficit (summed over ranks with ``all_reduce``, a
        collective every rank calls; skipped on every rank alike while no expert is boosted). Returns the
        ``(layer, expert)`` pairs whose deficit reached zero in ``iteration``."""
        if not self.active:  # `deficit` is identical on every rank: all skip the all_reduce together
            self._extra.zero_()
            return []
        if self.all_reduce is not None:
            self.all_reduce(self._extra)
        extra = self._extra.cpu()
        was = self.deficit > 0
        self.deficit = (self.deficit - extra).clamp(min=0)
        self._extra.zero_()
        done = was & (self.deficit == 0)
        self.made_up_at[done] = iteration
        return [(self.moe_layers[int(r)], int(e)) for r, e in done.nonzero().tolist()]

    @property
    def active(self) -> bool:
        return bool((self.deficit > 0).any())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of ``deficit``, ``owed`` and ``made_up_at`` (snapshot metadata tensors)."""
        return {"deficit": self.deficit.clone(), "owed": self.owed.clone(), "made_up_at": self.made_up_at.clone()}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["deficit"].shape) != tuple(self.deficit.shape):
            raise ValueError(f"capacity-boost state of shape {tuple(state['deficit'].shape)} does not match this "
                             f"model's {tuple(self.deficit.shape)} (MoE layers x experts)")
        self.deficit = state["deficit"].to(torch.float64).clone()
        self.owed = state["owed"].to(torch.float64).clone()
        self.made_up_at = state["made_up_at"].to(torch.int64).clone()
        self._extra.zero_()


class PopularityRouter(TopKRouter):
    """Megatron's top-k router; after routing it calls ``popularity.record(layer, routing_map, probs)``
    for training forwards (grad enabled, module in training mode). ``layer`` is the global 0-based layer
    index (Megatron's ``layer_number - 1``). With a :class:`CapacityBoost` attached it drops tokens per
    expert (:func:`per_expert_token_dropping`, MoEtion §6 capacity boost of stale experts)."""

    popularity = None
    capacity = None

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        if self.capacity is not None:
            layer_idx = int(self.layer_number) - 1
            factors = (self.capacity.capacity_factors(layer_idx) if self.training else
                       torch.full((routing_map.shape[1],), self.capacity.config.capacity_factor, dtype=torch.float64))
            probs, routing_map = per_expert_token_dropping(probs, routing_map, topk=self.topk, capacity_factors=factors)
            if self.training and torch.is_grad_enabled():
                self.capacity.record(layer_idx, routing_map, self.topk)
        return probs, routing_map

    def take_over_token_dropping(self, capacity_factor: float) -> None:
        """Drop tokens here, per expert (:func:`per_expert_token_dropping`), instead of in Megatron's
        ``TopKRouter.routing``: the router gets a copy of its config with ``moe_expert_capacity_factor``
        unset (the layer's config keeps it, so the token dispatcher still expects dropped tokens). With
        equal factors this drops exactly the tokens Megatron's ``drop_policy="probs"`` drops."""
        cfg = self.config
        if cfg.moe_router_enable_expert_bias:
            raise ValueError("the capacity boost drops tokens after routing, so the aux-loss-free expert bias "
                             "would count dropped tokens: drop --moe-router-enable-expert-bias or the boost")
        if cfg.moe_expert_capacity_factor is None:
            return  # no Megatron dropping to take over (the boost's base factor does it all)
        if float(cfg.moe_expert_capacity_factor) != float(capacity_factor):
            raise ValueError(f"capacity boost base factor {capacity_factor} differs from the model's "
                             f"--moe-expert-capacity-factor {cfg.moe_expert_capacity_factor}")
        if cfg.moe_pad_expert_input_to_capacity or cfg.moe_token_drop_policy != "probs":
            raise ValueError("the capacity boost drops tokens by probability without padding: it needs "
                             "moe_token_drop_policy='probs' and moe_pad_expert_input_to_capacity off")
        self.config = copy.copy(cfg)
        self.config.moe_expert_capacity_factor = None

    def forward(self, input: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().forward(input, *args, **kwargs)
        if self.popularity is not None and self.training and torch.is_grad_enabled():
            self.popularity.record(int(self.layer_number) - 1, routing_map, probs)
        return probs, routing_map


def install_router(spec, router_cls: type = PopularityRouter):
    """Put ``router_cls`` into a GPT layer spec (Megatron's ``MoESubmodules.router``); returns ``spec``.

    Also makes the router's gating runnable where Transformer Engine is absent (:func:`gating_without_te`):
    the CPU layer does that on CPU, but a TE-less CUDA install hits the same Megatron bug."""
    mlp = getattr(spec.submodules, "mlp", None)
    submodules = getattr(mlp, "submodules", None)
    if submodules is None or not hasattr(submodules, "router"):
        raise ValueError("the layer spec has no MoE router to replace; build it with --num-experts > 0")
    submodules.router = router_cls
    gating_without_te()
    return spec


def gating_without_te() -> None:
    """Megatron-Core 0.16.1 reads ``moe_utils.te_general_gemm`` in ``RouterGatingLinearFunction.forward``
    on every router call but defines it only when Transformer Engine imports: on a TE-less install, CPU
    or CUDA, every router forward raises ``NameError``. Define it as ``None`` (Megatron's own "no TE"
    value, which selects the plain matmul) when it is missing; idempotent, leaves a TE install alone.
    (``moe_ft.compat.cpu`` applies the same shim on CPU.)"""

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _routers(model_chunks: Iterable) -> list["PopularityRouter"]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, PopularityRouter)]


def attach_popularity(model_chunks: Iterable, popularity) -> int:
    """Point every :class:`PopularityRouter` of the model chunks at ``popularity``; returns how many."""
    routers = _routers(model_chunks)
    for router in routers:
        router.popularity = popularity
    return len(routers)


def attach_capacity_boost(model_chunks: Iterable, boost: CapacityBoost) -> int:
    """Point every :class:`PopularityRouter` of the model chunks at ``boost`` (each takes over Megatron's
    token dropping, :meth:`PopularityRouter.take_over_token_dropping`); returns how many."""
    routers = _routers(model_chunks)
    for router in routers:
        router.take_over_token_dropping(boost.config.capacity_factor)
        router.capacity = boost
    return len(routers)
