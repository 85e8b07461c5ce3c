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
                            with ``--fp8-recipe delayed|tensorwise``
fp8 (mxfp8/blockwise)       TE block-scaled recipes                          refused (block scales
                                                                             not captured)
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
            text += f" (FP8 via {self.fp8_source}, {self.fp8_recipe} scaling)"
        if self.loss_scaling != "none":
            text += f", {self.loss_scaling} loss scaling"
        return text

    def exact_recovery_problem(self) -> str | None:
        """Why snapshots of this configuration would not restore bit for bit (``None``: they do)."""
        if self.fp8_source == "transformer_engine" and self.fp8_recipe in ("mxfp8", "blockwise"):
            return (f"--ft cannot recover --fp8-recipe {self.fp8_recipe} exactly: its block-scaled tensors' row-/"
                    "column-wise scales are not captured by moe-ft snapshots; use --fp8-recipe delayed or "
                    "tensorwise, or train without --ft")
        return None


def check_exact_recovery(args) -> None:
    """Raise ``ValueError`` (one line, with the fix) when ``--ft`` would restore this precision inexactly."""
    problem = PrecisionConfig.from_args(args).exact_recovery_problem()
    if problem:
        raise ValueError(problem)
