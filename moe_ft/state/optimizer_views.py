"""Where Megatron's optimizers keep the fp32 master weight and the Adam state of each model parameter.

Megatron-Core 0.16.1 wraps one optimizer per parameter set (dense / expert) in a ``ChainedOptimizer``;
each is one of

* ``FP32Optimizer``: the torch optimizer updates the model parameter itself — the master weight *is*
  the compute weight (aliased);
* ``Float16OptimizerWithFloat16Params``: bf16/fp16 parameters get a separate fp32 master copy
  (``fp32_from_float16_groups``); fp32 parameters of the same optimizer are their own master;
* ``DistributedOptimizer``: each data-parallel rank owns a contiguous range of every parameter's
  flattened elements (possibly empty); its master shard is a fresh fp32 tensor for bf16/fp16 parameters
  and a *view* of the model parameter for fp32 parameters (aliased again).

:func:`main_states` maps every model parameter this rank updates to a :class:`MainState`. This module
only reads Megatron's attributes; it never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

# Plain Megatron needs, defined beside the training loop's checkpoint loading (re-exported here).
from megatron.training.optimizer_state import ensure_optimizer_state, leaf_optimizers  # noqa: F401


@dataclass(kw_only=True)
class MainState:
    """The optimizer-side state of one model parameter on this rank.

    ``master``: the fp32 master tensor, or ``None`` when it shares memory with the model parameter
    (fp32 training: then the compute weight already holds the master's bytes, and capturing the compute
    weight captures the master — counted once). ``state``: the torch optimizer's per-parameter tensors
    (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``), shards when ``shard`` is set. ``shard``: ``(start,
    end)`` of the flattened parameter that this rank owns with the distributed optimizer, else ``None``.
    """

    master: torch.Tensor | None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    shard: tuple[int, int] | None = None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _tensor_state(torch_optimizer, main: torch.Tensor) -> dict[str, torch.Tensor]:
    state = torch_optimizer.state.get(main, {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _distributed(opt) -> Iterator[tuple[torch.nn.Parameter, MainState]]:
    for model_param, (group_idx, order) in opt.model_param_group_index_map.items():
        main = opt.optimizer.param_groups[group_idx]["params"][order]
        rng = opt._get_model_param_range_map(model_param)["param"]
        master = None if _shares_memory(main, model_param) else main
        yield model_param, MainState(master=master, state=_tensor_state(opt.optimizer, main),
                                     shard=(int(rng.start), int(rng.end)))


def _float16(opt) -> Iterator[tuple[torch.nn.Parameter, MainState]]:
    for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model_param, main in zip(model_group, main_group):
            yield model_param, MainState(master=main, state=_tensor_state(opt.optimizer, main))
    for group in opt.fp32_from_fp32_groups:
        for model_param in group:
            yield model_param, MainState(master=None, state=_tensor_state(opt.optimizer, model_param))


def _fp32(opt) -> Iterator[tuple[torch.nn.Parameter, MainState]]:
    for group in opt.optimizer.param_groups:
        for model_param in group["params"]:
            yield model_param, MainState(master=None, state=_tensor_state(opt.optimizer, model_param))


def distributed_params(optimizer) -> set[int]:
    """``id`` of every model parameter a ``DistributedOptimizer`` of ``optimizer`` shards, including those
    of which this rank owns no element (absent from :func:`main_states`)."""
    return {id(param) for opt in leaf_optimizers(optimizer) if isinstance(opt, DistributedOptimizer)
            for buffer in opt.buffers for param in buffer.param_index_map}


def main_states(optimizer) -> dict[int, tuple[torch.nn.Parameter, MainState]]:
    """``id(model_param) -> (model_param, MainState)`` for every parameter this rank's optimizers update.

    Raises ``ValueError`` for optimizer layouts the registry cannot decompose (precision-aware
    optimizer, which keeps master weights inside Transformer Engine's FusedAdam)."""

    out: dict[int, tuple[torch.nn.Parameter, MainState]] = {}
    for opt in leaf_optimizers(optimizer):
        config = getattr(opt, "config", None)
        if getattr(config, "use_precision_aware_optimizer", False):
            raise ValueError("the operator registry cannot see master weights kept inside the precision-aware "
                             "optimizer; train without --use-precision-aware-optimizer")
        if isinstance(opt, DistributedOptimizer):
            pairs = _distributed(opt)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            pairs = _float16(opt)
        elif isinstance(opt, FP32Optimizer):
            pairs = _fp32(opt)
        else:
            raise ValueError(f"unsupported Megatron optimizer {type(opt).__name__}; the registry knows "
                             "FP32Optimizer, Float16OptimizerWithFloat16Params and DistributedOptimizer")
        for model_param, main in pairs:
            if id(model_param) in out:
                raise RuntimeError("a model parameter is updated by two optimizers; cannot assign its state")
            out[id(model_param)] = (model_param, main)
    return out
