"""Experts module holding an arbitrary multiset of expert replicas per EP rank (Lazarus §4.1-4.2).

``ElasticExperts`` is Megatron's ``SequentialMLP`` with one ``MLP`` per *distinct* expert the rank holds
(``held_experts``, ascending). Several slots of one expert on one rank share that MLP: their replicas would
hold identical weights and, after the gradient sum, identical gradients, so separate copies would only cost
memory; the slot count still sets the rank's share of the expert's tokens (the dispatch capacity).

Initialisation: the standard-EP experts Megatron builds first (same RNG stream as a standard run) are the
source; every expert is broadcast from its standard-EP home rank to its holders. So all replicas of an
expert are identical, and the layer equals standard EP with the same seed, parameter for parameter.

Gradients: the replicas of expert ``e`` see disjoint shares of ``e``'s tokens, so the standard-EP
gradient is the sum over exactly its holders. ``HolderGradSum`` is an identity on the local weights whose
backward does one all-reduce over the EP group of a dense buffer with a row per replicated expert (zeros
from ranks that do not hold it; experts with a single holder are not communicated). It runs once per
micro-batch inside autograd, before Megatron's DDP hooks see the gradient, so DDP's own reduction over the
expert-data-parallel group (same EP rank in other EP groups, which hold the same plan) follows unchanged:
no gradient is counted twice. One collective per layer in a fixed order on every rank (no per-holder-set
process groups: no ordering hazards between overlapping groups, nothing to create per pipeline stage, and
nothing to rebuild when a later reconfiguration changes the plan). Cost: every EP rank moves the gradients
of all replicated experts, not only its own.

Gradient norm: Megatron's clipping norm sums squares over the expert model-parallel group; replicas of an
expert after the sum hold the same gradient, so every holder but the first marks its parameters
``shared`` (Megatron's flag for duplicated parameters, e.g. tied embeddings) and the norm -- hence
clipping -- equals standard EP's.

Checkpoints (``sharded_state_dict``): the layout of standard EP's ``SequentialMLP`` -- expert ``e`` is slice
``e`` of the ``experts.*`` sharded tensors -- written once per expert by its first holder; the other
holders carry a non-zero replica id. The optimizer state follows the parameters' sharded tensors, so a
checkpoint loads into any replica plan and into standard EP, and back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from moe_ft import comm


class HolderGradSum:
    """Sums replicated experts' weight gradients over their holders (one all-reduce over ``ep_group``)."""

    def __init__(self, replicas: torch.Tensor, held_experts: list[int], expert_numel: int, ep_group):
        holders = (replicas > 0).sum(1)
        self.shared = [e for e in range(replicas.shape[0]) if holders[e] > 1]
        self.row_of = {e: row for row, e in enumerate(self.shared)}
        self.held_experts = held_experts
        self.expert_numel = expert_numel
        self.ep_group = ep_group

    @property
    def active(self) -> bool:
        return bool(self.shared)

    def reduce(self, grads_per_expert: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``grads_per_expert[i]``: gradients of ``held_experts[i]``'s parameters; returns them summed."""
        ref = grads_per_expert[0][0]
        buf = torch.zeros(len(self.shared), self.expert_numel, dtype=torch.float32, device=ref.device)
        for e, grads in zip(self.held_experts, grads_per_expert):
            if e in self.row_of:
                torch.cat([g.reshape(-1).float() for g in grads], out=buf[self.row_of[e]])
        comm.all_reduce(buf, group=self.ep_group)  # device path: the gradients' device (NCCL on GPU)
        out = []
        for e, grads in zip(self.held_experts, grads_per_expert):
            if e not in self.row_of:
                out.append(grads)
                continue
            pieces = buf[self.row_of[e]].split([g.numel() for g in grads])
            out.append([p.view_as(g).to(g.dtype) for p, g in zip(pieces, grads)])
        return out


class _HolderGradSumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reducer: HolderGradSum, num_params: int, *weights):
        ctx.reducer, ctx.num_params = reducer, num_params
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.num_params
        per_expert = [list(grads[i : i + n]) for i in range(0, len(grads), n)]
        summed = ctx.reducer.reduce(per_expert)
        return (None, None, *(g for expert in summed for g in expert))


class ElasticExperts(SequentialMLP):
    """``SequentialMLP`` over ``held_experts`` (the distinct experts with ``replicas[e, ep_rank] > 0``).

    ``forward(hidden [num_rows, H], tokens_per_expert [len(held_experts)], probs [num_rows])``: rows grouped
    by held expert in ascending id, as ``ElasticTokenDispatcher.dispatch_postprocess`` returns them.
    """

    def __init__(self, config, submodules, pg_collection, *, replicas: torch.Tensor, num_slots: int | None = None):
        if config.fp8 or config.fp4:
            raise ValueError("the elastic experts do not support fp8/fp4; run in bf16 or fp32")
        ep_rank = dist.get_rank(pg_collection.ep)
        held_experts = (replicas[:, ep_rank] > 0).nonzero().flatten().tolist()
        if not held_experts:
            raise ValueError(f"EP rank {ep_rank} holds no expert replica; every rank needs >= 1 slot")
        num_mlps = len(held_experts) if num_slots is None else num_slots
        if num_mlps < len(held_experts):
            raise ValueError(f"EP rank {ep_rank} holds {len(held_experts)} distinct experts but has {num_slots} slots")
        super().__init__(num_mlps, config, submodules, pg_collection=pg_collection)
        self.expert_numel = sum(p.numel() for p in self.local_experts[0].parameters())
        self.set_plan(replicas, {e: i for i, e in enumerate(held_experts)})

    # ------------------------------------------------------------------------------------- the plan
    def set_plan(self, replicas: torch.Tensor, mlp_of: dict[int, int]) -> None:
        """Serve plan ``replicas`` (``R[e, j]``) with MLP ``mlp_of[e]`` for each expert this EP rank holds
        (the in-run rebalance, ``moe_ft/elastic/live.py``, moves the state first). MLPs holding no expert
        are *spare slots*: in no forward, no gradient (their state is overwritten before they serve);
        checkpoints write them under optional keys of their own (:meth:`_spare_sharded`)."""
        ep_rank = dist.get_rank(self.ep_group)
        held = (replicas[:, ep_rank] > 0).nonzero().flatten().tolist()
        if sorted(mlp_of) != held:
            raise ValueError(f"EP rank {ep_rank}: MLPs given for experts {sorted(mlp_of)} but plan holds {held}")
        num_mlps = len(self.local_experts)
        if len(set(mlp_of.values())) != len(mlp_of) or not all(0 <= i < num_mlps for i in mlp_of.values()):
            raise ValueError(f"EP rank {ep_rank}: MLP indices {mlp_of} must be distinct and < {num_mlps}")
        self.replicas = replicas
        self.held_experts = held
        self.mlp_index = [mlp_of[e] for e in held]
        """``local_experts`` index of each of ``held_experts``."""
        self.grad_sum = HolderGradSum(replicas, self.held_experts, self.expert_numel, self.ep_group)
        duplicates = {mlp_of[e] for e in held if int((replicas[e] > 0).nonzero()[0]) != ep_rank}
        for i, mlp in enumerate(self.local_experts):
            spare_or_duplicate = i in duplicates or i not in self.mlp_index
            for p in mlp.parameters():
                p.shared = spare_or_duplicate  # Megatron's grad norm / zero count skip it: each expert counted once

    @property
    def held_mlps(self) -> list:
        """The MLP of each of ``held_experts`` (same order)."""
        return [self.local_experts[i] for i in self.mlp_index]

    @property
    def expert_of_mlp(self) -> list[int]:
        """Global expert index served by each ``local_experts`` MLP, ``-1`` for a spare slot."""
        out = [-1] * len(self.local_experts)
        for e, i in zip(self.held_experts, self.mlp_index):
            out[i] = e
        return out

    @torch.no_grad()
    def copy_from_standard(self, standard: SequentialMLP) -> None:
        """Broadcast every expert from its standard-EP home rank (``e // num_local``) to its holders."""
        num_local = standard.num_local_experts
        ep_rank = dist.get_rank(self.ep_group)
        mine = dict(zip(self.held_experts, self.held_mlps))
        for e in range(self.replicas.shape[0]):
            home = e // num_local
            if home == ep_rank:
                flat = torch.cat([p.reshape(-1) for p in standard.local_experts[e % num_local].parameters()])
            else:
                ref = next(standard.parameters())
                flat = ref.new_empty(self.expert_numel)
            comm.broadcast(flat, src=dist.get_global_rank(self.ep_group, home), group=self.ep_group)
            if e in mine:
                params = list(mine[e].parameters())
                for p, piece in zip(params, flat.split([p.numel() for p in params])):
                    p.copy_(piece.view_as(p))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input is not supported by the elastic experts")
        mlps = self.held_mlps
        names = [[n for n, _ in mlp.named_parameters()] for mlp in mlps]
        weights = [p for mlp in mlps for p in mlp.parameters()]
        if self.grad_sum.active and torch.is_grad_enabled():
            weights = _HolderGradSumFn.apply(self.grad_sum, len(names[0]), *weights)
        n = len(names[0])
        rows = tokens_per_expert.tolist()
        outputs = []
        for i, (mlp, tokens, probs) in enumerate(zip(
            mlps, permuted_local_hidden_states.split(rows), permuted_probs.split(rows)
        )):
            params = dict(zip(names[i], weights[i * n : (i + 1) * n]))
            out, bias = torch.func.functional_call(mlp, params, (tokens, probs))
            assert bias is None, "expert MLPs are built without bias (add_bias_linear=False)"
            outputs.append(out)
        return torch.cat(outputs, dim=0), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Standard EP's checkpoint layout (``SequentialMLP.sharded_state_dict``): expert ``e``'s tensors are
        slice ``e`` of the ``experts.*`` sharded tensors (or ``experts.{e}.*`` with singleton local shards).

        Every expert is written once: its first holder (lowest EP rank) keeps Megatron's replica id
        ``(PP, TP, expert-DP rank)``, so the main replica is the first holder at expert-DP rank 0; the other
        holders get a non-zero replica id and are not written. Loading fills every holder from the same
        slice. Nothing in the layout depends on the plan, so a checkpoint moves between replica plans and
        standard EP in both directions, and the optimizer state (keyed by these sharded tensors) with it.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        num_experts = self.replicas.shape[0]
        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        ep_rank, dp_rank, dp_size = dist.get_rank(self.ep_group), self.dp_group.rank(), self.dp_group.size()
        sharded = {}
        expert_of = self.expert_of_mlp
        for local_idx, expert in enumerate(self.local_experts):
            e = expert_of[local_idx]
            local_prefix = f"{prefix}local_experts.{local_idx}."
            if e < 0:
                sharded.update(self._spare_sharded(expert, local_prefix, prefix, local_idx, sharded_offsets, metadata))
                continue
            if singleton_local_shards:
                sharded_prefix, offsets = f"{prefix}experts.{e}.", sharded_offsets
            else:
                sharded_prefix = f"{prefix}experts."
                offsets = (*sharded_offsets, (len(sharded_offsets), e, num_experts))
            expert_sd = expert.sharded_state_dict(local_prefix, offsets, metadata)
            replace_prefix_for_sharding(expert_sd, local_prefix, sharded_prefix)
            holders = (self.replicas[e] > 0).nonzero().flatten().tolist()
            holder_idx = holders.index(ep_rank)  # 0 on the first holder
            for key, sh_ten in expert_sd.items():
                replica_id = sh_ten.replica_id
                assert len(replica_id) == 3, f"expected a (PP, TP, DP) replica id for {key}, got {replica_id}"
                sh_ten.replica_id = (*replica_id[:2], dp_rank + holder_idx * dp_size)  # unique per copy
            sharded.update(expert_sd)
        return sharded

    def _spare_sharded(self, expert, local_prefix, prefix, local_idx, sharded_offsets, metadata):
        """A spare slot's tensors under keys of their own (``<prefix>optional.spare_slots.L<layer>.ep<j>.mlp<k>.``,
        one per layer, EP rank and MLP; the expert-DP copies are replicas): written, so that the optimizer's
        sharded state has a key for every parameter, and *optional* on load
        (``megatron/training/checkpointing.py``: absent under another replica plan, they keep their values --
        a spare slot holds no training state). A plain ``GPTModel`` never asks for them."""
        layer = sharded_offsets[0][1] if sharded_offsets else 0  # Megatron's layer axis: (axis, layer, num_layers)
        ep_rank = dist.get_rank(self.ep_group)
        expert_sd = expert.sharded_state_dict(local_prefix, (), metadata)
        replace_prefix_for_sharding(expert_sd, local_prefix,
                                    f"{prefix}optional.spare_slots.L{layer}.ep{ep_rank}.mlp{local_idx}.")
        for sh_ten in expert_sd.values():
            sh_ten.replica_id = (*sh_ten.replica_id[:2], self.dp_group.rank())
        return expert_sd
