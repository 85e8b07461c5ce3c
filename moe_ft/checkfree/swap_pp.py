"""CheckFree+ with pipeline parallelism: *swap the layers, not the route* (CheckFree §4.3;
``docs/checkfree.md`` says why Megatron-Core 0.16.1's schedules cannot route a micro-batch through the
stages in another order).

On a swapped micro-batch (the odd ones, ``swap.is_swapped``) the paper runs ``… S1, S0 …`` and
``… S_L, S_{L-1}``: the partners trade places in the route. The same function is computed when the
partners trade *weights* instead: rank 0 runs the embedding and then stage 1's layers, rank 1 stage 0's
layers; rank L-2 runs stage L-1's layers and rank L-1 stage L-2's, then the output layer. So each rank of
a pair

1. receives its partner's layer weights when the iteration's schedule starts (``config.no_sync_func``, which
   every Megatron schedule enters before its first send: both partners are there, nothing waits on the
   pipeline) and keeps them as *borrowed* leaf tensors;
2. runs a swapped micro-batch's layers with the borrowed tensors (:class:`SwapLayerMixin` on the layer
   class, installed through the layer spec, ``torch.func.functional_call``; Megatron's ``forward_step``
   tells each layer its ``current_microbatch``); autograd accumulates their gradients on the borrowed
   tensors, the own parameters (and Megatron DDP's hooks) are untouched by that micro-batch;
3. sends the borrowed tensors' gradients back and adds the partner's into its own ``main_grad`` before
   Megatron's ``finalize_model_grads`` (the data-parallel reduction, clipping and the optimizer see the
   gradient of the out-of-order route).

Cost: a stage's weights and their gradients cross between the partners every iteration (host path,
``docs/communication.md``) — the paper's "no extra communication" holds for its route, not for Megatron's
fixed one. Needs ``overlap_grad_reduce`` off (a bucket must not be reduced before the returned gradients
are in) and one model chunk per rank; the stages of a pair must have the same layers. Replays are exact:
the schedule of a replayed iteration runs the same exchange.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.transformer.spec_utils import ModuleSpec

from moe_ft import comm
from moe_ft.checkfree.average import stage_layers
from moe_ft.checkfree.swap import check_one_chunk, is_swapped, swap_partner


class SwapLayerMixin:
    """Mixed into the transformer layer class by :func:`install_swap_layers`: a swapped micro-batch runs the
    layer with its partner's borrowed weights (``self.checkfree_swap``, set by :meth:`PartnerSwap.attach`)."""

    checkfree_swap: PartnerSwap | None = None
    checkfree_position = 0
    _checkfree_inside = False

    def forward(self, *args, **kwargs):
        swap = self.checkfree_swap
        microbatch = getattr(self, "current_microbatch", None)
        if swap is None or not swap.active or self._checkfree_inside or microbatch is None or not is_swapped(microbatch):
            return super().forward(*args, **kwargs)
        self._checkfree_inside = True  # functional_call calls this forward again: run the layer itself then
        swap.ran.add(microbatch)
        try:
            return torch.func.functional_call(self, swap.borrowed[self.checkfree_position], args, kwargs, strict=False)
        finally:
            self._checkfree_inside = False


def install_swap_layers(spec):
    """The layer spec with its layer class made swap-capable (a subclass: module paths, parameters and
    checkpoints are unchanged)."""

    base = spec.module
    if isinstance(base, type) and issubclass(base, SwapLayerMixin):
        return spec
    cls = type(f"CheckFree{base.__name__}", (SwapLayerMixin, base), {"__module__": __name__})
    return ModuleSpec(module=cls, params=dict(spec.params), submodules=spec.submodules)


class PartnerSwap:
    """One rank's side of the swap (ranks with no partner hold an inactive instance)."""

    def __init__(self, model_chunks, *, pp_rank: int, pp_ranks: list[int]) -> None:
        check_one_chunk(len(model_chunks))  # refused at parsing (CheckFreeConfig.check_args); built directly too
        partner_stage = swap_partner(pp_rank, len(pp_ranks))
        self.partner = pp_ranks[partner_stage] if partner_stage is not None else None
        self.gpt = getattr(model_chunks[0], "module", model_chunks[0])
        self.layers = stage_layers(self.gpt)
        self.borrowed: list[dict[str, torch.Tensor]] = []
        self.active = False
        self.ran: set[int] = set()
        """Micro-batches of the running schedule whose layers ran with the partner's weights."""
        self.last_swapped: list[int] = []
        """Those of the last training schedule (observable: logs, tests)."""

    # ------------------------------------------------------------------------------------------ wiring
    def attach(self, config) -> "PartnerSwap":
        """Point the model's layers at this object and wrap the two Megatron config hooks (``no_sync_func``:
        borrow; ``finalize_model_grads_func``: return gradients)."""
        if self.partner is None:
            return self
        for position, layer in enumerate(self.gpt.decoder.layers):
            if not isinstance(layer, SwapLayerMixin):
                raise ValueError("the model was built without the swap-capable layer spec (install_swap_layers)")
            layer.checkfree_swap, layer.checkfree_position = self, position
        no_sync, finalize = config.no_sync_func or contextlib.nullcontext, config.finalize_model_grads_func

        def borrowing_no_sync():
            if torch.is_grad_enabled() and not self.active:  # a training schedule starts (not evaluation)
                self.borrow()
            return no_sync()

        def returning_finalize(*args, **kwargs):
            if self.active:
                self.give_back()
            return finalize(*args, **kwargs) if finalize is not None else None

        config.no_sync_func, config.finalize_model_grads_func = borrowing_no_sync, returning_finalize
        return self

    # -------------------------------------------------------------------------------------- exchange
    def _trade(self, payload):
        """Send ``payload`` to the partner and receive its (lower rank sends first: no cycle)."""
        if dist.get_rank() < self.partner:
            comm.send_object(payload, self.partner)
            return comm.recv_object(self.partner)
        received = comm.recv_object(self.partner)
        comm.send_object(payload, self.partner)
        return received

    def borrow(self) -> None:
        """Trade layer weights with the partner; keep the partner's as leaf tensors on this rank's device."""
        mine = [{n: t.detach().cpu() for n, t in layer.items()} for layer in self.layers]
        theirs = self._trade(mine)
        if len(theirs) != len(self.layers) or any(set(a) != set(b) for a, b in zip(theirs, self.layers)):
            raise ValueError("CheckFree+ partners must hold the same layers (same count and architecture)")
        self.borrowed = [{n: t.to(own[n].device).requires_grad_(isinstance(own[n], torch.nn.Parameter))
                          for n, t in layer.items()} for layer, own in zip(theirs, self.layers)]
        self.active = True

    def give_back(self) -> None:
        """Trade the borrowed tensors' gradients; add the partner's into this rank's own gradients."""
        grads = [{n: t.grad.detach().cpu() for n, t in layer.items() if t.grad is not None} for layer in self.borrowed]
        theirs = self._trade(grads)
        with torch.no_grad():
            for layer, own in zip(theirs, self.layers):
                for name, g in layer.items():
                    param = own[name]
                    main = getattr(param, "main_grad", None)
                    if main is not None:
                        main.add_(g.to(main.device, main.dtype))
                    elif param.grad is None:
                        param.grad = g.to(param.device, param.dtype).clone()
                    else:
                        param.grad.add_(g.to(param.device, param.dtype))
        self.borrowed, self.active = [], False
        self.last_swapped, self.ran = sorted(self.ran), set()
