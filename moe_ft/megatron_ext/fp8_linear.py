"""FP8 compute weights without Transformer Engine: Megatron's local linear layers with the weight kept as
``torch.float8`` data plus delayed scaling (``--fp8-format e4m3 --fp8-emulation``; MoEvement §5.7 trains
with FP8 compute weights; a restored FP8 run must continue bit for bit).

This is the CPU-testable stand-in for TE's FP8 with FP8 model weights: every linear layer of the
transformer layers (attention ``linear_qkv``/``linear_proj`` and each expert's ``linear_fc1``/``linear_fc2``;
not the router, norms, embeddings or output layer — the layers TE runs in FP8) computes with
``dequantize(fp8_data, scale_inv)`` instead of its parameter; the weight's gradient passes straight through
to the parameter (what an FP8 GEMM's wgrad is), the optimizer updates the fp32 master, and right after
every optimizer step each updated weight is re-quantized from its master with the delayed-scaling state of
:class:`moe_ft.precision.fp8.FP8WeightState` (amax history, next scale). Only weights are quantized here;
activations and gradients stay in the parameter dtype (the ``hybrid`` format keeps weights in E4M3 too).

Wiring, at Megatron's seams:

* :func:`install_fp8_linears` puts :class:`FP8ColumnParallelLinear` / :class:`FP8RowParallelLinear` (subclasses
  overriding ``_forward_impl``, where both pass the weight to the GEMM) into the layer spec;
* :func:`attach_fp8_emulation` (after the optimizer exists) gives each of them its FP8 state, quantized from
  the master, sets ``weight.fp8_state`` (how the operator registry and the recovery find the FP8 compute
  state of a weight) and registers a step post-hook on each torch optimizer that re-quantizes the weights
  whose master it just updated (a master without a gradient — a frozen operator during replay, or any
  parameter the step skipped — keeps its FP8 state untouched).
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from moe_ft.precision.fp8 import DelayedScalingConfig, FP8WeightState, dequantize
from moe_ft.state.optimizer_views import leaf_optimizers, main_states


class _FP8Weight(torch.autograd.Function):
    """Forward: the dequantized FP8 weight in ``weight``'s dtype; backward: the gradient goes to ``weight``
    unchanged (straight through: the weight gradient of ``y = x W_q^T`` is ``dy^T x`` whatever ``W_q``)."""

    @staticmethod
    def forward(ctx, weight, data, scale_inv):
        return dequantize(data, scale_inv, weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _FP8Linear:
    """Mixin for Megatron's parallel linear layers: the GEMM reads the FP8 weight (``fp8_state``).

    Checkpoints (``--save``/``--load``, dist_checkpointing): the FP8 state travels as the layer's
    ``_extra_state`` (where Transformer Engine keeps its ``fp8_meta``; Megatron saves it as a sharded
    object, per expert for expert layers), so a resumed run continues with the same FP8 data, scales and
    amax history. A checkpoint without it (from a run without ``--fp8-emulation``) re-quantizes the loaded
    weight with a fresh scaling state."""

    fp8_state: FP8WeightState | None = None

    def get_extra_state(self):
        if self.fp8_state is None:
            return None
        return {name: t.detach().cpu().clone() for name, t in self.fp8_state.tensors().items()}

    def set_extra_state(self, state) -> None:
        live = self.fp8_state
        if live is None:
            return  # loaded before attach_fp8_emulation: attach quantizes from the loaded weight
        if not state:  # a checkpoint of a run without FP8 emulation: start the FP8 state from this weight
            fresh = FP8WeightState(tuple(live.data.shape), config=live.config, device=live.data.device)
            for dst, src in zip(live.tensors().values(), fresh.tensors().values()):
                dst.copy_(src)
            live.quantize_from(self.weight)
            return
        tensors = live.tensors()
        if set(state) != set(tensors):
            raise ValueError(f"FP8 checkpoint state has {sorted(state)}, expected {sorted(tensors)}")
        for name, dst in tensors.items():
            src = state[name]
            if src.dtype != dst.dtype or src.shape != dst.shape:
                raise ValueError(f"FP8 checkpoint state {name}: {src.dtype}{tuple(src.shape)} vs this run's "
                                 f"{dst.dtype}{tuple(dst.shape)} (another --fp8-format or --fp8-amax-history-len)")
            dst.copy_(src)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if weight is self.weight:
            state = self.fp8_state
            if state is None:
                raise RuntimeError(f"{type(self).__name__} has no FP8 state: call moe_ft.megatron_ext.fp8_linear."
                                   "attach_fp8_emulation(model, optimizer, config) after building the optimizer")
            weight = _FP8Weight.apply(weight, state.data, state.scale_inv)
        return super()._forward_impl(input, weight, *args, **kwargs)


class FP8ColumnParallelLinear(_FP8Linear, ColumnParallelLinear):
    """``ColumnParallelLinear`` computing with its FP8 weight."""


class FP8RowParallelLinear(_FP8Linear, RowParallelLinear):
    """``RowParallelLinear`` computing with its FP8 weight."""


_REPLACE = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}


def _swap(submodules, names: tuple[str, ...], where: str) -> None:
    for name in names:
        current = getattr(submodules, name)
        if current not in _REPLACE:
            raise ValueError(f"--fp8-emulation replaces Megatron's local ColumnParallelLinear/RowParallelLinear; "
                             f"{where}.{name} is {getattr(current, '__name__', current)!r} (use --transformer-impl "
                             "local and no --moe-grouped-gemm)")
        setattr(submodules, name, _REPLACE[current])


def install_fp8_linears(spec):
    """A copy of a GPT layer spec (Megatron's local MoE spec) whose attention and expert linear layers are
    the FP8 ones; shared experts too, if the spec has them."""
    spec = copy.deepcopy(spec)  # specs may be shared between builds: never edit the caller's
    layer = spec.submodules
    _swap(layer.self_attention.submodules, ("linear_qkv", "linear_proj"), "self_attention")
    moe = getattr(layer.mlp, "submodules", None)
    experts = getattr(moe, "experts", None)
    if getattr(experts, "submodules", None) is None:
        raise ValueError("--fp8-emulation needs the MoE layer spec with SequentialMLP experts (no --moe-grouped-gemm)")
    _swap(experts.submodules, ("linear_fc1", "linear_fc2"), "mlp.experts")
    shared = getattr(moe, "shared_experts", None)
    if getattr(shared, "submodules", None) is not None:
        _swap(shared.submodules, ("linear_fc1", "linear_fc2"), "mlp.shared_experts")
    return spec


def fp8_linears(model_chunks: Iterable) -> list[_FP8Linear]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, _FP8Linear)]


def _requantize_hook(pairs: list[tuple[FP8WeightState, torch.Tensor]]):
    def hook(_optimizer, _args, _kwargs) -> None:
        for state, master in pairs:
            if master.grad is not None or getattr(master, "decoupled_grad", None) is not None:
                state.quantize_from(master)
    return hook


def attach_fp8_emulation(model_chunks: Iterable, optimizer, config: DelayedScalingConfig) -> int:
    """Give every FP8 linear layer of ``model_chunks`` its FP8 state, quantized from its master, and hook
    the re-quantization after each step into ``optimizer`` (a Megatron optimizer, possibly chained).
    Returns the number of FP8 weights. Needs whole fp32 masters (per-tensor amax): not the distributed
    optimizer's shards."""

    model_chunks = list(model_chunks)
    linears = fp8_linears(model_chunks)
    if not linears:
        raise RuntimeError("no FP8 linear layers in the model: build the layer spec with install_fp8_linears "
                           "(--fp8-emulation)")
    mains = main_states(optimizer)
    owner = {id(p): opt.optimizer for opt in leaf_optimizers(optimizer) if getattr(opt, "optimizer", None) is not None
             for group in opt.optimizer.param_groups for p in group["params"]}
    pairs: dict[int, tuple[object, list]] = {}
    for layer in linears:
        weight = layer.weight
        entry = mains.get(id(weight))
        if entry is None:
            raise RuntimeError("an FP8 weight that no optimizer updates (frozen): --fp8-emulation expects trainable "
                               "linear layers")
        main = entry[1]
        if main.shard is not None:
            raise ValueError("--fp8-emulation re-quantizes each weight from its whole fp32 master; the distributed "
                             "optimizer holds only shards: drop --use-distributed-optimizer")
        master = weight if main.master is None else main.master
        state = FP8WeightState(tuple(weight.shape), config=config, device=weight.device)
        state.quantize_from(master)
        layer.fp8_state = state
        weight.fp8_state = state  # Megatron-style parameter attribute: the weight's FP8 compute state
        inner = owner[id(master)]
        pairs.setdefault(id(inner), (inner, []))[1].append((state, master))
    for inner, items in pairs.values():
        inner.register_step_post_hook(_requantize_hook(items))
    return len(linears)
