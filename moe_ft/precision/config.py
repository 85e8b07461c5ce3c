"""Precision of each kind of training state, and which combinations moe-ft recovers exactly.

MoEvement §5.7 / Table 7 evaluates five low-precision configurations (compute / master / optimizer state):
FP16/FP16/FP16+FP16, FP8/FP32/FP32+FP32, FP8/FP16/FP32+FP32, FP8/FP16/FP8+FP16, FP8/FP8/FP8+FP16. A snapshot
stores every tensor in the dtype it lives in, byte for byte (``moe_ft/store/codec.py`` knows every
``torch.float8_*`` dtype), so *storing* any of them is exact; what decides exactness is whether the
operator registry sees all the state that the next iterations read:

==========================  ===============================================  =====================
compute / master / optim    how it runs here                                 with ``--ft``
==========================  ===============================================  =====================
fp32 / fp32 / fp32          default (master aliased to the weight)           exact
bf16 / fp32 / fp32          ``--bf16``                                       exact
fp16 / fp32 / fp32          ``--fp16`` (+ dynamic loss scaler, per-iteration  exact (scaler state in
                            state)                                           the step metadata)
fp8 / fp32 / fp32           ``--fp8-format e4m3 --fp8-emulation`` (torch     exact (FP8 data, scales,
                            float8 weights, delayed scaling), or TE FP8      amax histories captured)
                            with ``--fp8-recipe delayed``
fp8 (tensorwise, mxfp8,     TE current-scaling and block-scaled recipes      exact: no FP8 state
blockwise) / bf16 params    on bf16 parameters                               (scales computed from
                                                                             each tensor as it is
                                                                             quantized)
fp16 or fp8 master,         Transformer Engine's precision-aware FusedAdam   not reachable: this
fp8+fp16 optimizer state    (master and moments inside TE)                   build has no flag for
                                                                             it; the registry refuses
                                                                             it (optimizer_views)
==========================  ===============================================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.training.extensions import check_extension


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """What dtype each kind of state lives (and is snapshotted) in, derived from Megatron's flags. Names
    follow ``moe_ft.sim.config.PrecisionSpec`` (the simulator's Table 7 configurations)."""

    compute: str
    """Compute weights: ``fp32``, ``bf16``, ``fp16`` or ``fp8`` (FP8 data + scale, for the linear layers of
    the transformer layers; embeddings, norms, router and output layer stay in the parameter dtype)."""
    master: str = "fp32"
    optimizer: tuple[str, str] = ("fp32", "fp32")
    """Adam ``exp_avg``, ``exp_avg_sq``."""
    loss_scaling: str = "none"
    """``dynamic`` (fp16's ``DynamicGradScaler``), ``static`` (``--loss-scale``) or ``none``."""
    fp8_source: str = ""
    """``emulation`` (moe-ft's torch float8 layers), ``transformer_engine``, or empty."""
    fp8_recipe: str = ""

    @classmethod
    def from_args(cls, args) -> "PrecisionConfig":
        m, t = args.model, args.training
        wide = "bf16" if m.bf16 else "fp16" if m.fp16 else "fp32"
        fp8 = bool(m.fp8_format)
        scaling = "none"
        if m.fp16:
            scaling = "static" if getattr(t, "loss_scale", None) else "dynamic"
        emulated = any(check_extension(e).emulates_fp8 for e in getattr(args, "extra", {}).values())
        source = ("emulation" if emulated else "transformer_engine") if fp8 else ""
        return cls(compute="fp8" if fp8 else wide, loss_scaling=scaling, fp8_source=source,
                   fp8_recipe=m.fp8_recipe if fp8 else "")

    def describe(self) -> str:
        text = f"compute {self.compute} / master {self.master} / optimizer {'+'.join(self.optimizer)}"
        if self.fp8_source:
            text += f" (FP8 via {self.fp8_source}, {self.fp8_recipe} scaling; FP8 state: {self.fp8_state()})"
        if self.loss_scaling != "none":
            text += f", {self.loss_scaling} loss scaling"
        return text

    def fp8_state(self) -> str:
        """What FP8 state survives an iteration, i.e. what a snapshot must hold besides the weights.

        Delayed scaling (TE's ``DelayedScaling``, the emulation) computes each scale from an amax history that
        every quantization extends: per FP8 tensor a history and a scale, captured (TE's ``fp8_meta`` and a
        quantizer's scale/amax when the snapshot is submitted: the next forward rolls them in place). The
        current-scaling recipes -- ``tensorwise`` (TE's ``Float8CurrentScaling``), and the block-scaled
        ``mxfp8`` and ``blockwise`` -- compute every scale from the tensor being quantized, so with the
        parameters in bf16 (this build has no flag for FP8 parameters) nothing FP8 outlives the iteration:
        restoring the bf16 weights and the optimizer restores everything."""
        if not self.fp8_source:
            return "none"
        if self.fp8_recipe == "delayed":
            return "amax history and scale per FP8 tensor (captured)"
        return "none (current scaling: scales computed from each tensor as it is quantized)"
