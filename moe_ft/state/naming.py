"""Which operator  a Megatron-Core ``GPTModel`` parameter belongs to, by its module path.

``embedding.*`` → ``embedding``; ``output_layer.*`` and ``decoder.final_layernorm.*`` → ``output``;
inside ``decoder.layers.<i>`` (``i`` local to the pipeline stage, mapped to the global layer through the
layer's ``layer_number``): ``mlp.router.*`` → ``gate(layer)``; ``mlp.experts.local_experts.<j>.*``
(``SequentialMLP``) and ``mlp.experts.linear_fc{1,2}.weight<j>`` (``TEGroupedMLP``, one weight per local
expert) → ``expert(layer, global_expert_indices(mlp)[j])`` (standard EP's ``local_expert_indices``, or the
elastic layer's ``held_experts``: replicated experts sit on several ranks); everything else of the layer (attention, norms,
shared experts, which see every token) → ``dense(layer)``.

``GroupedMLP`` keeps all local experts in one ``weight1``/``weight2``: :func:`grouped_expert_views` cuts
per-expert views out of them (see there).
"""

from __future__ import annotations

import re

import torch

from moe_ft.state.operators import OperatorId

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_TE_GROUPED = re.compile(r"^mlp\.experts\.linear_fc[12]\.(?:weight|bias)(\d+)$")
_GROUPED = re.compile(r"^mlp\.experts\.weight[12]$")


def operator_of(name: str, gpt) -> OperatorId | None:
    """The operator of parameter/buffer ``name`` of ``gpt`` (the unwrapped ``GPTModel``), or ``None`` for
    a ``GroupedMLP`` weight, which holds several experts (use :func:`grouped_expert_views`)."""
    if name.startswith("embedding."):
        return OperatorId.embedding()
    if name.startswith("output_layer.") or name.startswith("decoder.final_layernorm."):
        return OperatorId.output()
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"parameter {name!r} belongs to no known operator; extend moe_ft/state/naming.py "
                         "for this model layout")
    layer_module = gpt.decoder.layers[int(m.group(1))]
    layer = int(layer_module.layer_number) - 1
    rest = m.group(2)
    if rest.startswith("mlp.router."):
        return OperatorId.gate(layer)
    local = _SEQUENTIAL.match(rest) or _TE_GROUPED.match(rest)
    if local is not None:
        expert = global_expert_indices(layer_module.mlp)[int(local.group(1))]
        if expert < 0:
            raise ValueError(f"{name} is a spare expert slot (no expert, no operator); skip it with is_spare_expert()")
        return OperatorId.expert_op(layer, expert)
    if _GROUPED.match(rest):
        return None
    return OperatorId.dense(layer)


def global_expert_indices(moe_layer) -> list[int]:
    """Global expert index of each local expert module of ``moe_layer``, in ``local_experts`` order.

    Standard EP: ``MoELayer.local_expert_indices`` (a contiguous block per EP rank). The elastic layer
    (``ElasticMoELayer``, Lazarus §4.1) holds an arbitrary set of replicated experts: its experts module's
    ``expert_of_mlp`` (``held_experts`` in MLP order; ``-1`` marks a spare slot kept for in-run rebalancing),
    which need not be contiguous and may differ in number from ``E / EP``.
    """
    experts = getattr(moe_layer, "experts", None)
    if experts is not None and getattr(experts, "held_experts", None) is not None:
        return [int(e) for e in experts.expert_of_mlp]
    return [int(e) for e in moe_layer.local_expert_indices]


_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)\d+\.")


def plan_free_name(name: str) -> str:
    """A tensor name of an operator entry without the local expert index (``...local_experts.3.w`` ->
    ``...local_experts.*.w``): which MLP of a rank serves an expert depends on the replica plan and on the
    rebalances since the model was built; the expert (one operator) does not."""
    return _LOCAL_EXPERT.sub(r"\1*.", name)


def is_spare_expert(name: str, gpt) -> bool:
    """Whether parameter ``name`` of ``gpt`` belongs to a spare expert slot of an elastic MoE layer (an MLP
    that serves no expert until a rebalance moves one into it): part of no operator."""
    m = _LAYER.match(name)
    if m is None:
        return False
    local = _SEQUENTIAL.match(m.group(2))
    if local is None:
        return False
    return global_expert_indices(gpt.decoder.layers[int(m.group(1))].mlp)[int(local.group(1))] < 0


def grouped_expert_views(name: str, weight: torch.Tensor, num_local_experts: int) -> list[torch.Tensor]:
    """Per-local-expert views of a ``GroupedMLP`` weight (Megatron layout): ``weight1``
    ``[hidden, num_local * ffn']`` → ``[hidden, ffn']`` column blocks; ``weight2`` ``[num_local * ffn,
    hidden]`` → ``[ffn, hidden]`` row blocks. The views share memory with ``weight`` and together cover it
    exactly once."""
    if name.endswith("weight1"):
        hidden = weight.shape[0]
        return list(weight.view(hidden, num_local_experts, -1).unbind(1))
    if name.endswith("weight2"):
        return list(weight.view(num_local_experts, -1, weight.shape[-1]).unbind(0))
    raise ValueError(f"{name!r} is not a GroupedMLP weight1/weight2")
