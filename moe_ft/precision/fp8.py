"""FP8 weights with per-tensor delayed scaling: the reference semantics of moe-ft's FP8 emulation.

This is what Transformer Engine's ``DelayedScaling`` recipe does for a weight kept in FP8 (``fp8_model_params``:
the model weight *is* FP8 data plus a scale, the fp32 master lives in the optimizer), written in plain
PyTorch with ``torch.float8_*`` so that it runs, deterministically, on a CPU:

* after every optimizer step the weight is re-quantized from its master: ``data = sat(master * scale)`` in
  the FP8 format, ``scale_inv = 1 / scale`` travels with the data (forward dequantizes
  ``data * scale_inv``);
* the quantization records the master's ``amax`` in an amax history (newest first, ``amax_history_len``
  entries) and derives the scale of the *next* quantization from it (TE's ``_default_sf_compute``):
  ``scale = (fp8_max / amax) / 2**margin`` with ``amax`` the history's maximum (``max``) or its newest entry
  (``most_recent``); an amax that is zero or not finite keeps the previous scale.

So the state of one FP8 weight is four tensors — ``data`` (FP8), ``scale_inv`` (fp32, the data's),
``scale`` (fp32, the next quantization's) and ``amax_history`` (fp32) — and every one of them is needed to
continue bit for bit: the scale of the next step depends on up to ``amax_history_len`` past masters, which a
restore cannot re-derive from the current master (MoEvement §5.7 runs FP8 compute weights).
All updates happen in place, so views taken once (the operator registry's) stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""Weight formats; TE's ``hybrid`` recipe keeps weights (and activations) in E4M3 and gradients in E5M2."""
AMAX_ALGOS = ("max", "most_recent")


def weight_format(fp8_format: str) -> str:
    """The format weights are stored in under Megatron's ``--fp8-format`` (``e4m3`` or ``hybrid``)."""
    if fp8_format in ("e4m3", "hybrid"):
        return "e4m3"
    raise ValueError(f"unknown --fp8-format {fp8_format!r}; expected e4m3 or hybrid")


@dataclass(frozen=True, kw_only=True)
class DelayedScalingConfig:
    """TE's delayed-scaling recipe knobs for weights (Megatron-LM flag names in parentheses)."""

    fmt: str = "e4m3"
    """Weight format: ``e4m3`` (``float8_e4m3fn``, max 448) or ``e5m2`` (max 57344)."""
    margin: int = 0
    """The scale is divided by ``2**margin`` (``--fp8-margin``)."""
    amax_history_len: int = 16
    """Past amaxes kept per weight (``--fp8-amax-history-len``)."""
    amax_compute_algo: str = "max"
    """``max`` over the history or ``most_recent`` (``--fp8-amax-compute-algo``)."""

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"FP8 weight format must be one of {sorted(FORMATS)}, got {self.fmt!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be one of {AMAX_ALGOS}, got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.fmt]

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale`` to ``dtype`` (TE saturates; a plain cast of an out-of-range value to
    ``float8_e4m3fn`` would give NaN). ``scale``: fp32 ``[1]``."""
    limit = float(torch.finfo(dtype).max)
    return (x.to(torch.float32) * scale).clamp_(-limit, limit).to(dtype)


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` in ``dtype`` (the values forward computes with)."""
    return (data.to(torch.float32) * scale_inv).to(dtype)


def next_scale(amax_history: torch.Tensor, scale: torch.Tensor, config: DelayedScalingConfig) -> torch.Tensor:
    """The scale of the next quantization from the amax history (TE ``_default_sf_compute``)."""
    amax = amax_history.max() if config.amax_compute_algo == "max" else amax_history[0]
    new = (config.fp8_max / amax) / (2.0 ** config.margin)
    keep = ~((amax > 0.0) & torch.isfinite(amax))
    return torch.where(keep, scale, new.reshape(scale.shape).to(scale.dtype))


class FP8WeightState:
    """The FP8 copy of one weight and its scaling state (see the module docstring).

    ``data``: ``dtype`` tensor shaped like the weight; ``scale_inv``, ``scale``: fp32 ``[1]``;
    ``amax_history``: fp32 ``[amax_history_len]``, newest first. Fresh state: zeros, scale 1 (TE's)."""

    TENSORS = ("fp8_data", "fp8_scale_inv", "fp8_scale", "fp8_amax_history")
    """Names of the state tensors (the suffixes snapshots store them under)."""

    def __init__(self, shape, *, config: DelayedScalingConfig, device=None) -> None:
        self.config = config
        self.data = torch.zeros(shape, dtype=config.dtype, device=device)
        self.scale_inv = torch.ones(1, dtype=torch.float32, device=device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(config.amax_history_len, dtype=torch.float32, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` of the state (the live tensors, not copies)."""
        return dict(zip(self.TENSORS, (self.data, self.scale_inv, self.scale, self.amax_history)))

    @torch.no_grad()
    def quantize_from(self, master: torch.Tensor) -> None:
        """Re-quantize from ``master`` (after an optimizer step): data with the current scale, record
        ``amax(master)``, derive the next scale. In place."""
        if master.shape != self.data.shape:
            raise ValueError(f"master {tuple(master.shape)} does not match the FP8 weight {tuple(self.data.shape)}")
        self.data.copy_(quantize(master, self.scale, self.config.dtype))
        torch.reciprocal(self.scale, out=self.scale_inv)
        amax = master.detach().abs().max().to(torch.float32)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = amax
        self.scale.copy_(next_scale(self.amax_history, self.scale, self.config))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.data, self.scale_inv, dtype)
