"""Quantized weights as snapshots must see them: FP8 bytes plus scaling metadata, never a wider dtype.

A snapshot copies tensors byte for byte. A Transformer Engine ``Float8Tensor`` is a ``torch.Tensor``
subclass whose nominal dtype is bf16: copying it like a tensor would *dequantize* it, and restoring would
re-quantize — not bitwise (Megatron-LM PR #6666: MXFP8 → BF16 → MXFP8 shifts 52 of 1024 scale blocks),
and the scale and amax history would be lost. So every quantized weight is decomposed here into the plain
tensors that *are* its state, and the registry captures those (MoEvement §5.7, Table 7: FP8 compute
weights):

* moe-ft's FP8 emulation (:class:`moe_ft.precision.fp8.FP8WeightState`, attached to the weight as
  ``weight.fp8_state``): ``fp8_data`` (``float8_e4m3fn``), ``fp8_scale_inv``, ``fp8_scale``,
  ``fp8_amax_history``. The wide weight stays a parameter (the fp32/bf16 weight the optimizer updates).
* TE ``Float8Tensor`` parameters (per-tensor scaling; duck-typed — ``_data``, ``_scale_inv``,
  ``_fp8_dtype`` — so TE is never imported): ``fp8_data`` (``_data`` itself: the uint8 storage TE keeps the
  FP8 bytes in), ``fp8_scale_inv`` and, when the tensor carries a quantizer, ``fp8_quantizer_scale``
  / ``fp8_quantizer_amax``. The parameter *is* the FP8 data (no wide copy); its transpose cache is derived
  from ``_data`` and is invalidated after a restore.
* TE modules' delayed-scaling state ``fp8_meta["scaling_fwd"|"scaling_bwd"]`` (``scale``, ``scale_inv``,
  ``amax_history``): per module, stored with the operator of the module's first parameter (a grouped expert
  GEMM's state is shared by its local experts and lives with the first one; every snapshot of a window's
  first iteration holds every operator, so it is always restored); a module without parameters (TE's
  ``DotProductAttention``, which keeps scaling state for FP8 attention) with the operator its path names.
  TE creates this state at a module's first FP8 forward: ``moe_ft.precision.te_fp8`` creates it before a
  registry is built on a model that has not run one (a recovery).

TE's forward pass writes the delayed-scaling state in place (the amax history rolls and the scale is
recomputed when an FP8 autocast region ends), while a snapshot's copy of iteration ``t`` may still run
during the forward of ``t + 1`` (it only has to finish before the next optimizer step). Those tensors are
marked *forward-mutated*: the snapshot engine copies them on the compute stream when the snapshot is
submitted (``moe_ft/snapshot/engine.py``), so a point holds the state as of ``t``.

Block-scaled tensors (MXFP8, FP8 blockwise: ``_rowwise_data``/``_columnwise_scale_inv``) are refused: their
layout is not captured yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                  "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_BLOCK_SCALED_ATTRS = ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv")
_TE_META_KEYS = ("scaling_fwd", "scaling_bwd")
_TE_META_ATTRS = ("scale", "scale_inv", "amax_history")


def is_float8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FLOAT8_DTYPES


def is_te_float8_tensor(obj) -> bool:
    """A TE ``Float8Tensor`` / ``Float8TensorStorage`` (per-tensor FP8), recognised by its attributes."""
    return (isinstance(getattr(obj, "_data", None), torch.Tensor)
            and isinstance(getattr(obj, "_scale_inv", None), torch.Tensor) and hasattr(obj, "_fp8_dtype"))


def is_block_scaled(obj) -> bool:
    """A TE MXFP8 / blockwise-FP8 tensor (its data and scales are split row-/column-wise)."""
    return any(isinstance(getattr(obj, a, None), torch.Tensor) for a in _BLOCK_SCALED_ATTRS)


@dataclass(kw_only=True)
class QuantizedWeight:
    """The plain tensors holding one quantized weight's state (live views, never copies)."""

    tensors: dict[str, torch.Tensor]
    """``suffix → tensor``; snapshots store them as ``<weight name>.<suffix>``."""
    has_wide_copy: bool
    """The parameter is a separate wide weight (emulation: the fp32/bf16 weight the FP8 data is quantized
    from); ``False`` when the parameter *is* the FP8 tensor (TE)."""
    after_restore: list[Callable[[], None]] = field(default_factory=list)
    """Called after the tensors were overwritten by a restore (drop caches derived from them)."""
    forward_mutated: frozenset[str] = frozenset()
    """Suffixes of :attr:`tensors` that the *forward pass* writes in place (TE's delayed scaling updates a
    quantizer's scale and amax when an FP8 autocast region ends), not only the optimizer step: a snapshot
    must capture them when it is submitted, before the next forward (:attr:`OperatorState.forward_mutated`)."""

    @property
    def data(self) -> torch.Tensor:
        return self.tensors["fp8_data"]


def _invalidate_transpose(tensor) -> Callable[[], None]:
    def invalidate() -> None:
        if hasattr(tensor, "_transpose_invalid"):
            tensor._transpose_invalid = True
    return invalidate


def quantized_weight(param) -> QuantizedWeight | None:
    """The :class:`QuantizedWeight` of a parameter, or ``None`` for a plain one. Raises ``ValueError`` for a
    block-scaled TE tensor."""
    state = getattr(param, "fp8_state", None)
    if state is not None:
        return QuantizedWeight(tensors=state.tensors(), has_wide_copy=True)
    if is_block_scaled(param):
        raise ValueError(f"a block-scaled (MXFP8 / FP8 blockwise) {type(param).__name__} weight: moe-ft snapshots "
                         "do not capture its row-/column-wise scales yet; use --fp8-recipe delayed or tensorwise")
    if not is_te_float8_tensor(param):
        return None
    if param._data.dtype != torch.uint8 and not is_float8_dtype(param._data.dtype):
        raise ValueError(f"Float8Tensor data of dtype {param._data.dtype}; expected uint8 or a torch.float8 dtype")
    # the live tensor objects themselves (not views made here): the recovery maps them back to their
    # master parameters by identity (moe_ft/recovery/optim.py)
    tensors = {"fp8_data": param._data, "fp8_scale_inv": param._scale_inv}
    quantizer = getattr(param, "_quantizer", None)
    for attr in ("scale", "amax"):
        value = getattr(quantizer, attr, None)
        if isinstance(value, torch.Tensor):
            tensors[f"fp8_quantizer_{attr}"] = value
    return QuantizedWeight(tensors=tensors, has_wide_copy=False, after_restore=[_invalidate_transpose(param)],
                           forward_mutated=frozenset(k for k in tensors if k.startswith("fp8_quantizer_")))


def module_scaling_state(module) -> dict[str, torch.Tensor]:
    """A TE module's delayed-scaling tensors: ``fp8_meta.<scaling_fwd|scaling_bwd>.<scale|scale_inv|
    amax_history>`` (empty for modules without ``fp8_meta``)."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict):
        return {}
    out = {}
    for key in _TE_META_KEYS:
        holder = meta.get(key)
        for attr in _TE_META_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, torch.Tensor):
                out[f"fp8_meta.{key}.{attr}"] = value
    return out


def quantized_state(gpt) -> tuple[dict[str, QuantizedWeight], dict[str, tuple[str, torch.Tensor]]]:
    """Everything FP8 in ``gpt`` (an unwrapped model): ``(weights, scaling)`` with ``weights[param name]``
    the parameter's :class:`QuantizedWeight` and ``scaling[name] = (owner, tensor)`` for the TE modules'
    ``fp8_meta`` tensors (``owner`` names the operator: the module's first parameter, or ``name`` itself for a
    module without parameters)."""
    weights = {}
    for name, param in gpt.named_parameters():
        q = quantized_weight(param)
        if q is not None:
            weights[name] = q
    scaling = {}
    for mname, module in gpt.named_modules():
        state = module_scaling_state(module)
        if not state:
            continue
        first = next((n for n, _ in module.named_parameters(recurse=False)), None)
        if first is None and not mname:
            raise ValueError("the model itself has FP8 scaling state but no parameter to attribute it to")
        prefix = f"{mname}." if mname else ""
        for suffix, tensor in state.items():
            # a module without parameters (TE's DotProductAttention) belongs to the operator its path names
            scaling[prefix + suffix] = (prefix + (first if first is not None else suffix), tensor)
    return weights, scaling


def quantized_tensors(gpt) -> dict[str, torch.Tensor]:
    """Flat ``name → tensor`` of all FP8 state of ``gpt`` (for digests and inspection)."""
    weights, scaling = quantized_state(gpt)
    out = {f"{name}.{suffix}": t for name, q in weights.items() for suffix, t in q.tensors.items()}
    out.update({name: t for name, (_, t) in scaling.items()})
    return out
