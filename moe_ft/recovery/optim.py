"""Optimizer side of replay: the recorded-norm optimizer step and frozen operators.

**Why an override** (exactness pitfall the papers do not mention): Megatron clips gradients by the
*global* gradient norm. During a sparse-to-dense replay frozen operators contribute no weight gradient,
so the norm computed during replay would differ from the original run's, and so would the clip factor
and every active operator's update. :class:`RecordedStepOptimizer` therefore steps with the *recorded*
global norm of the iteration (stored in the snapshot metadata, ``moe_ft/snapshot/meta.py``).

**Why frozen operators get no update at all**: Adam is not a no-op on a zero gradient (the moments
decay, weight decay moves the weight, ``step`` advances). The wrapper drops the gradients of frozen
operators' master parameters before clipping, so torch's Adam skips them (``grad is None``): their
weights, masters and moments are untouched by the step.

It is a wrapper object around the Megatron optimizer (not a monkeypatch): ``step()`` is composed of
Megatron's public pieces in Megatron's own order — ``prepare_grads`` (copy to main grads, unscale,
found-inf, loss-scale update), ``clip_grad_by_total_norm_fp32`` with the given norm, then
``step_with_ready_grads`` — and every other attribute is the wrapped optimizer's.
"""

from __future__ import annotations

from typing import Iterable

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from moe_ft.precision.quantized import quantized_weight
from moe_ft.state.optimizer_views import leaf_optimizers


def main_params_by_model_param(optimizer) -> dict[int, list[torch.Tensor]]:
    """``id(model parameter) → [the torch optimizer's parameters that update it]`` on this rank (the
    parameter itself for ``FP32Optimizer``, its fp32 copy for the float16 optimizer, its shard for the
    distributed optimizer). A weight whose compute state is FP8 (``moe_ft.precision.quantized``) is also
    found by its FP8 data tensor — the compute weight the operator registry lists for it — so that a
    frozen FP8 operator's masters are frozen too."""

    out = _by_model_param(optimizer)
    for model_param, mains in list(out.values()):
        q = quantized_weight(model_param)
        if q is not None:
            out[id(q.data)] = (q.data, mains)
    return {key: mains for key, (_, mains) in out.items()}


def _by_model_param(optimizer) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
    out: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if hasattr(opt, "model_param_group_index_map"):
            for model_param, (group_idx, order) in opt.model_param_group_index_map.items():
                main = inner.param_groups[group_idx]["params"][order]
                out.setdefault(id(model_param), (model_param, []))[1].append(main)
        elif hasattr(opt, "float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model_param, main in zip(model_group, main_group):
                    out.setdefault(id(model_param), (model_param, []))[1].append(main)
            for group in opt.fp32_from_fp32_groups:
                for model_param in group:
                    out.setdefault(id(model_param), (model_param, []))[1].append(model_param)
        else:
            for group in inner.param_groups:
                for param in group["params"]:
                    out.setdefault(id(param), (param, []))[1].append(param)
    return out


class RecordedStepOptimizer:
    """Wraps a Megatron optimizer for one replayed iteration.

    ``grad_norm``: the global gradient norm recorded for the iteration (clipping uses it instead of the
    norm of this replay's gradients); ``found_inf``: the recorded found-inf flag (a mismatch means the
    replay diverged and raises); ``frozen_mains``: master parameters of frozen operators, whose gradients
    are dropped so the step leaves them alone."""

    def __init__(self, inner, *, grad_norm: float, found_inf: bool, frozen_mains: Iterable[torch.Tensor],
                 use_recorded_norm: bool = True) -> None:
        self.inner = inner
        self.grad_norm = float(grad_norm)
        self.found_inf = bool(found_inf)
        self.frozen_mains = list(frozen_mains)
        self.use_recorded_norm = use_recorded_norm

    def __getattr__(self, name):  # everything else is the wrapped optimizer's
        return getattr(self.inner, name)

    @torch.no_grad()
    def step(self):
        found_inf = bool(self.inner.prepare_grads())
        if found_inf != self.found_inf:
            raise RuntimeError(f"replay diverged: found-inf is {found_inf} but the original iteration recorded "
                               f"{self.found_inf}; the replayed state is not the recorded one")
        if found_inf:
            return False, None, None
        for main in self.frozen_mains:
            main.grad = None
            if hasattr(main, "decoupled_grad"):
                main.decoupled_grad = None
        norm = self.grad_norm if self.use_recorded_norm else float(self.inner.get_grad_norm())
        for opt in leaf_optimizers(self.inner):
            params = [p for p in opt.get_parameters() if p.grad is not None] if opt.optimizer is not None else []
            # as Megatron's step: an infinite norm clips by 0 (every gradient zeroed), a NaN one leaves them
            if params and opt.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return self.inner.step_with_ready_grads(), norm, None
