"""Rebuilding a lost pipeline stage from its two neighbours (CheckFree §4.2, Algorithm 1).

The formula (Alg. 1 line 3)::
    W_{s,i} <- (w_{i-1} W_{s,i-1} + w_{i+1} W_{s,i+1}) / (w_{i-1} + w_{i+1}),   w_j = ||grad W_{s,j}||^2

Which tensors, precisely (the paper speaks of "the weights of a stage"; ``docs/checkfree.md``):

* A stage's *layers* are the transformer layers of its model chunk, ``decoder.layers.<k>.*`` with ``k``
  the position inside the stage (Megatron numbers module paths per stage). Layer position ``k`` of the
  lost stage is rebuilt from layer position ``j`` of the previous stage and ``j'`` of the next one, tensor
  by tensor under the same name inside the layer (attention, norms, router, every local expert). With
  expert parallelism the neighbour ranks at the same expert-parallel rank hold the same global experts
  under the same local names.
* Equal layer counts (the usual even split): ``j = j' = k``. Different counts (Megatron's uneven first/
  last stage): layers are aligned by relative depth, ``j = floor(k * n_neighbour / n_lost)`` (e.g. a lost
  stage of 3 layers next to a stage of 2 takes that stage's layers 0, 0, 1). A neighbour with no layers,
  or a tensor whose name, shape or dtype differs between the aligned layers, is a :class:`ValueError`.
* The embedding, the final norm and the output layer are not layers: CheckFree+ restores them from the
  copies kept on the neighbouring stage (``copies.py``).

``w`` are *squared* gradient norms (Alg. 1 lines 1-2). The authors' code weights by the clipped,
non-squared norm plus 1e-4 (``docs/checkfree.md``); we follow the paper and the spec. Edge cases: both
weights zero (or not finite, e.g. the last step overflowed) give the uniform average, and the result says
so; one zero weight makes the rebuild a copy of the other neighbour, as the formula says.

Besides ``weighted`` (CheckFree), :func:`rebuild_layers` builds the baselines of Fig. 2 and of the
convergence study: ``uniform`` (w_{i-1} = w_{i+1}) and ``copy`` (w_{i+1} = 0, the previous stage). Random
re-initialisation is the model's own initialiser (``tools/plot_checkfree.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, cast

import torch

LayerTensors = Mapping[str, torch.Tensor]
"""One transformer layer's tensors by name inside the layer (``self_attention.linear_qkv.weight`` …)."""

STRATEGIES = ("weighted", "uniform", "copy")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_IN_LAYER = re.compile(r"(^|\.)decoder\.layers\.\d+\.")
"""A transformer-layer parameter under any wrapper prefix (DDP's ``module.``, ``Float16Module``'s)."""


@dataclass(frozen=True)
class Weights:
    """The normalised averaging weights actually used (``prev + next == 1``) and why."""

    prev: float
    next: float
    note: str = ""


def averaging_weights(grad_sq_prev: float, grad_sq_next: float, strategy: str = "weighted") -> Weights:
    """Normalised weights of the previous and next stage (CheckFree §4.2).

    ``grad_sq_*``: the neighbours' last squared gradient norms (Alg. 1 lines 1-2)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown rebuild strategy {strategy!r}; expected one of {STRATEGIES}")
    if strategy == "uniform":
        return Weights(0.5, 0.5, "uniform")
    if strategy == "copy":
        return Weights(1.0, 0.0, "copy of the previous stage")
    for name, value in (("previous", grad_sq_prev), ("next", grad_sq_next)):
        if value < 0:
            raise ValueError(f"the {name} stage's squared gradient norm is negative ({value}); pass ||grad||^2")
    if not (math.isfinite(grad_sq_prev) and math.isfinite(grad_sq_next)):
        return Weights(0.5, 0.5, f"uniform: a neighbour's squared gradient norm is not finite "
                                 f"({grad_sq_prev}, {grad_sq_next})")
    total = grad_sq_prev + grad_sq_next
    if total == 0.0:
        return Weights(0.5, 0.5, "uniform: both neighbours' gradient norms are zero")
    note = "copy: one neighbour's gradient norm is zero" if 0.0 in (grad_sq_prev, grad_sq_next) else ""
    return Weights(grad_sq_prev / total, grad_sq_next / total, note)


def align_layers(num_lost: int, num_neighbour: int) -> list[int]:
    """For each layer position of the lost stage, the neighbour's layer position it is built from."""
    if num_lost < 0 or num_neighbour <= 0:
        raise ValueError(f"cannot rebuild a stage of {num_lost} layers from a neighbour with {num_neighbour} "
                         "layers: CheckFree needs a neighbour holding transformer layers")
    return [(k * num_neighbour) // num_lost for k in range(num_lost)]


def average_layers(prev: Sequence[LayerTensors], nxt: Sequence[LayerTensors], num_lost: int,
                   weights: Weights) -> list[dict[str, torch.Tensor]]:
    """The rebuilt layers ``[num_lost]`` of the lost stage: ``prev`` / ``nxt`` are the neighbours' layers
    in order; each result tensor is ``weights.prev * W_prev + weights.next * W_next`` computed in float64
    and cast to the neighbours' dtype."""
    idx_prev, idx_next = align_layers(num_lost, len(prev)), align_layers(num_lost, len(nxt))
    out = []
    for k in range(num_lost):
        a, b = prev[idx_prev[k]], nxt[idx_next[k]]
        if set(a) != set(b):
            raise ValueError(f"layer {k} of the lost stage: the neighbours' layers {idx_prev[k]} and {idx_next[k]} "
                             f"hold different tensors ({sorted(set(a) ^ set(b))[:4]}…); CheckFree averages "
                             "layers of the same architecture")
        layer = {}
        for name, ta in a.items():
            tb = b[name]
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                raise ValueError(f"layer {k}, tensor {name!r}: {tuple(ta.shape)} {ta.dtype} vs "
                                 f"{tuple(tb.shape)} {tb.dtype} in the two neighbours")
            mixed = ta.detach().to(torch.float64) * weights.prev + tb.detach().to(torch.float64) * weights.next
            layer[name] = mixed.to(ta.dtype)
        out.append(layer)
    return out


def rebuild_layers(target: Sequence[LayerTensors], prev: Sequence[LayerTensors], nxt: Sequence[LayerTensors],
                   *, grad_sq_prev: float, grad_sq_next: float, strategy: str = "weighted") -> Weights:
    """Overwrite the lost stage's live layer tensors ``target`` in place (CheckFree Alg. 1 line 3) and
    return the weights used. ``target[k]`` must hold the names of the rebuilt layer ``k``."""
    weights = averaging_weights(grad_sq_prev, grad_sq_next, strategy)
    rebuilt = average_layers(prev, nxt, len(target), weights)
    with torch.no_grad():
        for k, (live, new) in enumerate(zip(target, rebuilt)):
            if set(live) != set(new):
                raise ValueError(f"layer {k} of the lost stage holds {sorted(set(live) ^ set(new))[:4]}… that its "
                                 "neighbours do not: the stages differ in architecture")
            for name, tensor in live.items():
                tensor.copy_(new[name])
    return weights


def stage_layers(gpt: torch.nn.Module, *, buffers: Iterable[str] = ("mlp.router.expert_bias",)) -> list[dict[str, torch.Tensor]]:
    """The layers of one stage's ``GPTModel`` (unwrapped or DDP-wrapped) as live tensors by name inside
    the layer: every parameter under ``decoder.layers.<k>.`` plus the listed float buffers (the router's
    expert bias, which training also moves). ``[num_layers_of_stage]``."""
    gpt = getattr(gpt, "module", gpt)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in [*gpt.named_parameters(), *((n, b) for n, b in gpt.named_buffers() if b is not None)]:
        m = _LAYER.match(name)
        if m is None:
            continue
        if not isinstance(tensor, torch.nn.Parameter) and not any(m.group(2).endswith(s) for s in buffers):
            continue
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
    return [layers.get(k, {}) for k in range(len(cast(Any, gpt).decoder.layers))]


def squared_grad_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """``||grad||^2`` over the given gradient tensors (CheckFree's ``w``), accumulated in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if g is not None:
            total += g.detach().to(torch.float64).pow(2).sum().cpu()
    return float(total)


def local_grad_sq(model_chunks) -> torch.Tensor:
    """``[1]`` float32 tensor on the gradients' device: this rank's squared gradient norm over its transformer
    layers (``decoder.layers.*``; Megatron DDP's ``main_grad`` buffers, else ``.grad``), computed without a
    host synchronisation (it is saved with the snapshot, ``moe_ft/checkfree/recovery.py``).

    CheckFree's ``w_j = ||grad W_{s,j}||^2`` (§4.2) is over the stage that is averaged: in the paper the
    (de-)embedding sits on a stage of its own (S_0, §4.3 footnote 3), so a neighbour's weight is the norm of
    its transformer blocks only. Megatron puts the embedding on the first stage and the final norm + output
    layer on the last one; their gradients (the output layer's dominates a tiny model's norm) are left out,
    so the first/last stage as a neighbour is weighted by the layers :func:`average_layers` averages. With
    the distributed optimizer only this rank's shard of the buffer holds the data-parallel sum; the rest
    holds the rank's own gradient, of the same scale."""
    def grad_of(p):
        g = getattr(p, "main_grad", None)
        return g if g is not None else p.grad

    grads = [g for chunk in model_chunks for name, p in chunk.named_parameters()
             if _IN_LAYER.search(name) and (g := grad_of(p)) is not None]
    if not grads:
        return torch.zeros(1)
    return torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum().reshape(1)
