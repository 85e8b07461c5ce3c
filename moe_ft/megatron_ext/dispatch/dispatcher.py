"""Flexible token dispatcher (Lazarus §4.2, Alg. 1) as a Megatron ``MoETokenDispatcher``.

Per micro-batch on EP rank ``i`` (``E`` experts, ``W`` EP ranks, ``N`` local tokens, ``k`` = top-k)::

    dispatch_preprocess  routing_map [N, E] -> expert_idx [N, k]; all-gather bincounts -> T [E, W];
                         schedule (moe_ft.megatron_ext.dispatch.arithmetic); send = permute(hidden) [N*k, H]
    token_dispatch       padding-free all_to_all_single over the EP group (gloo on CPU, NCCL on GPU)
    dispatch_postprocess (source rank, expert) -> expert-major; tokens_per_expert of the held experts
    combine_preprocess   expert-major -> (source rank, expert)
    token_combine        all_to_all_single back (split sizes swapped)
    combine_postprocess  out[t] = sum_k expert_out[slot t*k+k'] in k order -> [S, B, H]

As in Megatron's alltoall dispatcher the routing probabilities travel with the tokens and the experts
apply them (``MLP(..., per_token_scale=probs)``), so every expert sees exactly the inputs it sees under
standard expert parallelism and the combine is an unweighted sum. The all-gather of ``T`` and the split
sizes need host integers: one device-to-host copy per layer and micro-batch, as in Megatron's dispatcher.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from moe_ft import comm
from moe_ft.megatron_ext.dispatch.arithmetic import (
    DispatchConfig,
    DispatchPermutation,
    build_permutation,
    check_flexible_model,
    dispatch_schedule,
    permute,
    recv_expert_order,
    unpermute,
)


class _Permute(torch.autograd.Function):
    """``send = permute(hidden)``; its adjoint is the unweighted combine (sum of a token's copies)."""

    @staticmethod
    def forward(ctx, hidden, perm: DispatchPermutation, config: DispatchConfig, ones: torch.Tensor):
        ctx.perm, ctx.config, ctx.ones = perm, config, ones
        return permute(hidden, perm, config)

    @staticmethod
    def backward(ctx, grad_send):
        return unpermute(grad_send.contiguous(), ctx.perm, ctx.ones, ctx.config), None, None, None


class _Combine(torch.autograd.Function):
    """``out[t] = sum_k expert_out[pos_of_slot[t*k + k']]`` (k order, fp32); its adjoint is ``permute``."""

    @staticmethod
    def forward(ctx, expert_out, perm: DispatchPermutation, config: DispatchConfig, ones: torch.Tensor):
        ctx.perm, ctx.config = perm, config
        return unpermute(expert_out, perm, ones, config)

    @staticmethod
    def backward(ctx, grad_out):
        return permute(grad_out.contiguous(), ctx.perm, ctx.config), None, None, None


class ElasticTokenDispatcher(MoETokenDispatcher):
    """Dispatch to an arbitrary multiset of replicas: ``replicas[e, j]`` replicas of expert ``e`` on EP rank
    ``j`` (``[E, W]``, the same on every rank). ``held_experts``: the distinct experts this rank holds,
    ascending -- the order of the blocks ``dispatch_postprocess`` hands to the experts module."""

    def __init__(self, replicas: torch.Tensor, config, pg_collection, dispatch_config: DispatchConfig):
        super().__init__(config=config, pg_collection=pg_collection)
        # refused at parsing (ElasticConfig.check_args); a dispatcher built directly is checked here
        check_flexible_model(expert_tp_size=self.tp_size, capacity_factor=config.moe_expert_capacity_factor,
                             pad_to_capacity=config.moe_pad_expert_input_to_capacity)
        if config.moe_router_padding_for_quantization:
            raise ValueError("the flexible dispatcher does not pad routing for quantization (fp8/fp4)")
        num_experts = config.num_moe_experts
        if tuple(replicas.shape) != (num_experts, self.ep_size):
            raise ValueError(f"replica map must be [num_experts={num_experts}, EP size={self.ep_size}], "
                             f"got {tuple(replicas.shape)}")
        self.ep_rank = dist.get_rank(self.ep_group)
        self.set_replicas(replicas)
        self.topk = config.moe_router_topk
        self.dispatch_config = dispatch_config

    def set_replicas(self, replicas: torch.Tensor) -> None:
        """Dispatch by plan ``replicas`` from the next forward on (an in-run rebalance swaps it between
        iterations, ``moe_ft/elastic/live.py``)."""
        if tuple(replicas.shape) != (self.config.num_moe_experts, self.ep_size):
            raise ValueError(f"replica map must be [num_experts={self.config.num_moe_experts}, EP size="
                             f"{self.ep_size}], got {tuple(replicas.shape)}")
        self.replicas = replicas.to(torch.int64).cpu()
        self.held_experts = (self.replicas[:, self.ep_rank] > 0).nonzero().flatten().tolist()

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``hidden_states: [S, B, H]``, ``routing_map, probs: [S*B, E]`` -> send buffer ``[S*B*k, H]`` and
        the probabilities ``[S*B*k]`` in the same order."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        num_tokens = hidden.shape[0]
        nonzero = routing_map.nonzero()  # [N*k, 2] rows ordered by (token, expert)
        if nonzero.shape[0] != num_tokens * self.topk:
            raise ValueError(f"the flexible dispatcher needs exactly top-{self.topk} experts per token, got "
                             f"{nonzero.shape[0]} routed slots for {num_tokens} tokens (token dropping?)")
        expert_idx = nonzero[:, 1].view(num_tokens, self.topk)  # ascending expert ids per token
        local_counts = torch.bincount(expert_idx.reshape(-1), minlength=routing_map.shape[1])
        gathered = local_counts.new_empty(self.ep_size * local_counts.numel())  # gloo wants a flat output
        comm.all_gather_into_tensor(gathered, local_counts, group=self.ep_group)  # device path
        tokens_per_expert = gathered.view(self.ep_size, -1).T.cpu()  # T[e, j]
        self.schedule = dispatch_schedule(tokens_per_expert, self.replicas, self.ep_rank)
        self.perm = build_permutation(expert_idx, self.schedule, self.dispatch_config)
        self.ones = torch.ones(num_tokens, self.topk, dtype=torch.float32, device=hidden.device)
        send = _Permute.apply(hidden, self.perm, self.dispatch_config, self.ones)
        slot_probs = probs.gather(1, expert_idx).reshape(-1)  # slot t*k + k'
        return send, slot_probs.index_select(0, self.perm.slot_of_pos.to(probs.device))

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The padding-free variable all-to-all of Alg. 1 (tokens and their probabilities)."""
        s = self.schedule
        return (all_to_all(self.ep_group, hidden_states, s.output_split_sizes, s.input_split_sizes),
                all_to_all(self.ep_group, probs, s.output_split_sizes, s.input_split_sizes))

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Receive order (source rank, expert) -> expert-major; ``tokens_per_expert[i]``: rows of
        ``held_experts[i]`` (a CPU int64 tensor, as Megatron's experts expect)."""
        order = recv_expert_order(self.schedule).to(hidden_states.device)
        self.restore = torch.empty_like(order)
        self.restore[order] = torch.arange(order.numel(), device=order.device)
        tokens_per_expert = self.schedule.recv_counts.sum(0)[self.held_experts]
        return hidden_states.index_select(0, order), tokens_per_expert, probs.index_select(0, order)

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states.index_select(0, self.restore)

    def token_combine(self, hidden_states: torch.Tensor):
        s = self.schedule
        return all_to_all(self.ep_group, hidden_states, s.input_split_sizes, s.output_split_sizes)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        out = _Combine.apply(hidden_states, self.perm, self.dispatch_config, self.ones)
        return out.view(self.hidden_shape)
