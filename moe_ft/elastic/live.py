"""Apply a rebalance to the running model, in place (Lazarus §4.3, §5).

Lazarus reconfigures "lazily, only after the current training step is finished" and moves the states of the
replicas a node gains with point-to-point transfers (§5). Here, between two iterations, on every rank:

1. the state of every expert this EP rank must send (:attr:`RebalancePlan.fetches` with ``src`` = this rank:
   compute weights, fp32 master, Adam ``exp_avg`` / ``exp_avg_sq`` / ``step``; the operator registry's FULL
   tensors) is copied aside, before anything changes;
2. every elastic MoE layer is re-pointed to its new plan in the layout a freshly built layer has
   (:func:`canonical_mlps`: the ``i``-th held expert in MLP ``i``, spare slots last), the dispatcher's
   replica map and the holders' gradient sum follow (``ElasticMoELayer.set_plan``). A kept expert whose MLP
   changes is copied there from a local copy taken in step 1. The canonical layout matters for exactness:
   Megatron reduces the gradient norm over the parameters in order, so a model rebuilt after a restart
   must hold every expert in the same MLP as the run it recovers. No parameter is created or freed --
   each EP rank keeps one MLP per slot (``--ft-expert-slots``) for the whole run -- so Megatron's DDP
   buffers and optimizer stay as built; only Megatron's ``shared`` flag (which copy of an expert the
   gradient norm counts) is set anew on the model parameters and their optimizer-side masters;
3. the operator registry is rebuilt (views of the new experts' tensors), and the transfers run in one
   global order ``(layer, expert, dst, src)`` on the host path (``comm.send_object`` / ``recv_object``,
   pickled host tensors: bit-exact), each received entry copied into its MLP with the checks of
   ``restore.copy_into``.

All replicas of an expert hold identical state (``ElasticExperts``), so it does not matter which holder
sends, and the model computes the same function before and after: only which replica serves which tokens
changes. Every EP group does the same moves inside itself (a layer's plan is the same in every EP group).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.elastic.rebalance import RebalancePlan
from moe_ft.elastic.restore import copy_into
from moe_ft.state.naming import plan_free_name
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.optimizer_views import main_states


def elastic_layers(model_chunks) -> dict:
    """``{layer_idx: ElasticMoELayer}`` (0-based global layer) of every elastic MoE layer of this rank."""
    out = {}
    for chunk in model_chunks:
        gpt = getattr(chunk, "module", chunk)
        for layer in gpt.decoder.layers:
            if getattr(layer.mlp, "replicas", None) is not None:
                out[int(layer.layer_number) - 1] = layer.mlp
    return out


def current_plans(layers: dict) -> dict[int, list[list[int]]]:
    """``{layer: R[e][j]}`` the layers serve now."""
    return {layer: module.replicas.tolist() for layer, module in sorted(layers.items())}


def canonical_mlps(held: list[int], num_mlps: int) -> dict[int, int]:
    """MLP of each expert of ``held`` (ascending) as a freshly built layer places them: the ``i``-th in MLP
    ``i``. Raises ``ValueError`` when the rank has fewer MLPs than distinct experts to hold."""
    if len(held) > num_mlps:
        raise ValueError(f"{len(held)} distinct experts do not fit in {num_mlps} MLPs; the elastic layer was "
                         "built without spare slots (--ft-rebalance-interval builds one MLP per slot)")
    return {e: i for i, e in enumerate(sorted(held))}


def sync_shared_flags(layers: dict, optimizer) -> None:
    """Megatron's gradient norm reads ``shared`` on the optimizer's parameters (the fp32 masters in mixed
    precision, copied from the model parameter when the optimizer was built): follow the model's flags."""

    mains = main_states(optimizer)
    for module in layers.values():
        for param in module.experts.parameters():
            entry = mains.get(id(param))
            master = entry[1].master if entry is not None else None
            if master is not None:
                master.shared = param.shared


@torch.no_grad()
def apply_rebalance(plan: RebalancePlan, *, layers: dict, optimizer, registry, rebuild_registry) -> tuple[object, dict]:
    """Collective over every rank (see the module docstring). ``registry``: the operator registry of the
    current plan; ``rebuild_registry()`` returns one for the re-pointed model. Returns the new registry and
    ``{"experts_received", "bytes_received", "bytes_sent", "seconds"}`` of this rank."""

    t0 = time.perf_counter()
    ep_group = ps.get_expert_model_parallel_group()
    ep_rank = dist.get_rank(ep_group)
    global_of = dist.get_process_group_ranks(ep_group)
    order = sorted(plan.fetches, key=lambda f: (f.layer, f.expert_idx, f.dst, f.src))

    def state_of(op: OperatorId) -> dict:
        return {plan_free_name(name): t.detach().cpu().clone() for name, t in registry[op].tensors(Level.FULL).items()}

    outgoing = {(f.layer, f.expert_idx, f.dst): state_of(OperatorId.expert_op(f.layer, f.expert_idx))
                for f in order if f.src == ep_rank}
    relocated = {}  # kept experts whose MLP changes: copied aside, put back below
    for layer, rows in sorted(plan.new.items()):
        module = layers[layer]
        replicas = torch.tensor(rows, dtype=torch.int64)
        experts = module.experts
        new_held = (replicas[:, ep_rank] > 0).nonzero().flatten().tolist()
        mlp_of = canonical_mlps(new_held, len(experts.local_experts))
        for e, i in zip(experts.held_experts, experts.mlp_index):
            if e in mlp_of and mlp_of[e] != i:
                relocated[OperatorId.expert_op(layer, e)] = state_of(OperatorId.expert_op(layer, e))
        module.set_plan(replicas, mlp_of)
    sync_shared_flags(layers, optimizer)
    registry = rebuild_registry()
    for op, tensors in relocated.items():
        copy_into(registry, op, tensors)
    stats = {"experts_received": 0, "bytes_received": 0, "bytes_sent": 0, "experts_relocated": len(relocated)}
    for f in order:
        op = OperatorId.expert_op(f.layer, f.expert_idx)
        if f.src == ep_rank:
            payload = outgoing[(f.layer, f.expert_idx, f.dst)]
            comm.send_object(payload, global_of[f.dst])
            stats["bytes_sent"] += sum(t.nbytes for t in payload.values())
        elif f.dst == ep_rank:
            stats["bytes_received"] += copy_into(registry, op, comm.recv_object(global_of[f.src]))
            stats["experts_received"] += 1
    stats["seconds"] = round(time.perf_counter() - t0, 6)
    return registry, stats
