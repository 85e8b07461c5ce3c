"""A ``TopKRouter`` that reports every training micro-batch's routing to the popularity counters
(MoEvement §3.5 activation counts ``A_j^l``, App. B soft counts; MoEtion §4.3; MoC §3.2).

Installed through the layer spec (:func:`install_router`); the counters are attached after the model is
built (:func:`attach_popularity`), so the spec holds no runtime object and nothing is global. Without an
attached counter the router behaves exactly like Megatron's.
"""

from __future__ import annotations

from typing import Iterable

import torch
from megatron.core.transformer.moe.router import TopKRouter


class PopularityRouter(TopKRouter):
    """Megatron's top-k router; after routing it calls ``popularity.record(layer, routing_map, probs)``
    for training forwards (grad enabled, module in training mode). ``layer`` is the global 0-based layer
    index (Megatron's ``layer_number - 1``)."""

    popularity = None

    def forward(self, input: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().forward(input, *args, **kwargs)
        if self.popularity is not None and self.training and torch.is_grad_enabled():
            self.popularity.record(int(self.layer_number) - 1, routing_map, probs)
        return probs, routing_map


def install_router(spec, router_cls: type = PopularityRouter):
    """Put ``router_cls`` into a GPT layer spec (Megatron's ``MoESubmodules.router``); returns ``spec``."""
    mlp = getattr(spec.submodules, "mlp", None)
    submodules = getattr(mlp, "submodules", None)
    if submodules is None or not hasattr(submodules, "router"):
        raise ValueError("the layer spec has no MoE router to replace; build it with --num-experts > 0")
    submodules.router = router_cls
    return spec


def attach_popularity(model_chunks: Iterable, popularity) -> int:
    """Point every :class:`PopularityRouter` of the model chunks at ``popularity``; returns how many."""
    count = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, PopularityRouter):
                module.popularity = popularity
                count += 1
    return count
