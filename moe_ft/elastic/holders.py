"""Which EP ranks hold which expert replicas in a built model (Lazarus §4.1), for the operator catalogue.

Under standard expert parallelism every expert lives on exactly one EP rank. The elastic layer
(``ElasticMoELayer``, ``--moe-token-dispatcher-type flexible``) puts replicas of one expert on several EP
ranks, so several ranks' operator registries list the same ``expert(layer, e)`` operator. Policies plan
over one global catalogue in which an operator has one *home* ``(pp_rank, ep_rank)`` (``docs/policies.md``).
For a replicated expert the home is its **first holder** (lowest EP rank), the same rank that writes the
expert into a Megatron checkpoint (``ElasticExperts.sharded_state_dict``). Every holder still snapshots its
replica: its store holds the expert in the plan's level, so any surviving holder can serve a recovery.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

import torch

from moe_ft.state.operators import OperatorInfo


def layer_replica_maps(model_chunks: Iterable) -> dict[int, torch.Tensor]:
    """``{layer_idx: R[e, j]}`` (0-based global layer) of every elastic MoE layer in this rank's chunks."""
    out: dict[int, torch.Tensor] = {}
    for chunk in model_chunks:
        gpt = getattr(chunk, "module", chunk)
        for layer in gpt.decoder.layers:
            replicas = getattr(layer.mlp, "replicas", None)
            if replicas is not None:
                out[int(layer.layer_number) - 1] = replicas
    return out


def home_ep_rank(replicas: torch.Tensor, expert_idx: int) -> int:
    """The first (lowest) EP rank holding ``expert_idx`` in ``R[e, j]``."""
    holders = (replicas[expert_idx] > 0).nonzero().flatten().tolist()
    if not holders:
        raise ValueError(f"expert {expert_idx} has no replica in the plan {replicas.tolist()}")
    return int(holders[0])


def with_home_ep_ranks(infos: Iterable[OperatorInfo], replica_maps: Mapping[int, torch.Tensor]) -> list[OperatorInfo]:
    """``infos`` with every expert of a layer in ``replica_maps`` (``{layer_idx: R[e, j]}``) listed under its
    home EP rank (first holder); other operators unchanged (pure: no model, no process group)."""
    out = []
    for info in infos:
        if info.op.is_expert and info.op.layer in replica_maps:
            info = replace(info, ep_rank=home_ep_rank(replica_maps[info.op.layer], info.op.expert))
        out.append(info)
    return out


def catalogue_infos(infos: Iterable[OperatorInfo], model_chunks: Iterable) -> list[OperatorInfo]:
    """This rank's ``OperatorInfo`` list with every replicated expert's ``ep_rank`` set to its home (first
    holder), so that the catalogue merge sees one EP rank per expert. Standard-EP experts are unchanged."""
    return with_home_ep_ranks(infos, layer_replica_maps(model_chunks))
