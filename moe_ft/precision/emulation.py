"""``--fp8-emulation``: FP8 compute weights without Transformer Engine, as a component the training loop
sees only through its generic seams (``customize_layer_spec``, ``after_optimizer_built``): the loop does
not import ``moe_ft`` (docs/architecture.md). See ``moe_ft/megatron_ext/fp8_linear.py`` and
``docs/precision.md``."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.training.argument_utils import field_help
from megatron.training.extensions import LoopExtension
from moe_ft.precision.fp8 import DelayedScalingConfig, weight_format


@dataclass(kw_only=True)
class FP8EmulationConfig(LoopExtension):
    """Runs ``--fp8-format`` on any device (CPU included) with torch float8 weights and delayed scaling."""

    fp8_emulation: bool = field(default=False, metadata=field_help(
        "Run --fp8-format without Transformer Engine (any device, CPU included): the attention and expert linear "
        "layers compute with torch float8 weights (delayed scaling, amax history), re-quantized from the fp32 "
        "master after every optimizer step (moe_ft/megatron_ext/fp8_linear.py). Needs --transformer-impl local "
        "and --fp8-recipe delayed."))

    @property
    def emulates_fp8(self) -> bool:
        """Read by the loop's argument validation: ``--fp8-format`` without Transformer Engine is served."""
        return self.fp8_emulation

    def check_args(self, args) -> None:
        """Flag combinations the emulation cannot serve (``ValueError`` naming the fix)."""
        if not self.fp8_emulation:
            return
        m, p = args.model, args.parallel
        if not m.fp8_format:
            raise ValueError("--fp8-emulation emulates --fp8-format: pass --fp8-format e4m3 (or hybrid)")
        if m.transformer_impl != "local" or m.moe_grouped_gemm:
            raise ValueError("--fp8-emulation replaces Megatron's local linear layers: use --transformer-impl "
                             "local without --moe-grouped-gemm (or Transformer Engine FP8 without --fp8-emulation)")
        if m.fp8_recipe != "delayed":
            raise ValueError(f"--fp8-emulation implements delayed scaling only; got --fp8-recipe {m.fp8_recipe}")
        if p.use_distributed_optimizer:
            raise ValueError("--fp8-emulation re-quantizes each weight from its whole fp32 master after the step; "
                             "the distributed optimizer holds master shards: drop --use-distributed-optimizer")
        if m.moe_token_dispatcher_type == "flexible":
            raise ValueError("--fp8-emulation is not wired into the flexible dispatcher's replicated experts; use "
                             "--moe-token-dispatcher-type alltoall or allgather")

    def delayed_scaling(self, args):
        """The delayed-scaling recipe from Megatron's ``--fp8-*`` flags."""

        m = args.model
        return DelayedScalingConfig(fmt=weight_format(m.fp8_format), margin=m.fp8_margin,
                                    amax_history_len=m.fp8_amax_history_len, amax_compute_algo=m.fp8_amax_compute_algo)

    def customize_layer_spec(self, spec):
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.megatron_ext.fp8_linear import install_fp8_linears

        if not self.fp8_emulation:
            return spec

        return install_fp8_linears(spec)

    def after_optimizer_built(self, model_chunks, optimizer, args) -> None:
        """FP8 state quantized from the masters; re-quantized after every optimizer step."""
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.megatron_ext.fp8_linear import attach_fp8_emulation

        if not self.fp8_emulation:
            return

        attach_fp8_emulation(list(model_chunks), optimizer, self.delayed_scaling(args))
