"""``--ft-checkfree-plus``: CheckFree+ (CheckFree §4.3) in a real run, as one nested config of ``FTConfig``.

With the flag, a pipeline-parallel job (>= 4 stages)

* builds its transformer layers swap-capable (the layer-spec seam, ``swap_pp.install_swap_layers``) and
  lets the swap partners trade layer weights for the odd micro-batches of every iteration
  (``swap_pp.PartnerSwap``, attached by the :class:`moe_ft.checkfree.component.PartnerSwapComponent`
  after the loop set Megatron's schedule hooks), so stage 1 learns to stand in for stage 0 and stage L-2
  for stage L-1;
* sends the embedding (stage 0) and the final norm + output layer (stage L-1) to the neighbouring stage
  after every optimizer step, where they are kept versioned by iteration in the holder's node-local
  directory (:class:`moe_ft.checkfree.component.CopiesComponent`, ``copies.py``);
* and so lets a recovery rebuild a lost *first or last* stage with no snapshot, replica or durable point:
  its layers copied from its swap partner, its embedding / output layer restored bitwise from the copy of
  the agreed iteration (``recovery.py``), level ``approximate``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron.training.argument_utils import field_help
from moe_ft.checkfree.copies import CopyStore
from moe_ft.checkfree.swap import check_num_stages, check_one_chunk

COPIES_DIRNAME = "checkfree_copies"


@dataclass(kw_only=True)
class CheckFreeConfig:
    """CheckFree+ (out-of-order micro-batches and embedding/output copies, CheckFree §4.3)."""

    plus: bool = field(default=False, metadata=field_help(
        "CheckFree+ (CheckFree §4.3): the odd micro-batches of every iteration run the first two and the last two "
        "pipeline stages in swapped order (partners trade layer weights, moe_ft/checkfree/swap_pp.py), and the "
        "embedding / output layer are copied to the neighbouring stage after every step, so that a lost first or "
        "last stage can be rebuilt (approximate) when no snapshot, replica or durable point holds it. Needs --ft, "
        ">= 4 pipeline stages with equal layer counts, one model chunk per rank (no virtual pipeline stages); recoveries that rebuild a stage need --ft-min-recovery-level "
        "approximate or none."))

    def check(self, ft: bool) -> None:
        """Flag combinations (``FTConfig.__post_init__``). With ``--ft-min-recovery-level`` above
        ``approximate`` the swap still trains and the copies are still kept, but a recovery that would
        rebuild a stage is refused (the planner's one-line stop)."""
        if self.plus and not ft:
            raise ValueError("--ft-checkfree-plus is part of the fault-tolerance runtime: add --ft")

    def check_args(self, args) -> None:
        """Checks against the model's flags (``FTConfig.check_args``)."""
        if not self.plus:
            return
        pp = args.parallel.pipeline_model_parallel_size
        try:
            check_num_stages(pp)
            # validate_args leaves None for one chunk per rank, else the chunks per rank (>= 2)
            check_one_chunk(args.parallel.virtual_pipeline_model_parallel_size or 1)
        except ValueError as e:
            raise ValueError(f"--ft-checkfree-plus: {e}") from None
        if args.model.num_layers % pp:
            raise ValueError(f"--ft-checkfree-plus swaps whole stages, which must hold the same layers: "
                             f"--num-layers {args.model.num_layers} is not a multiple of "
                             f"--pipeline-model-parallel-size {pp}")

    def customize_layer_spec(self, spec):
        """The swap-capable layer class (same module paths and parameters)."""
        if not self.plus:
            return spec
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.checkfree.swap_pp import install_swap_layers

        return install_swap_layers(spec)

    def copies_dir(self, job_dir: str, rank: int) -> str:
        """Where rank ``rank`` keeps the copies it holds: beside (not inside) its snapshot store."""
        return os.path.join(job_dir, COPIES_DIRNAME, f"rank{rank}")

    def copy_store(self, job_dir: str, rank: int):
        """This rank's :class:`moe_ft.checkfree.copies.CopyStore` (recovery reads the copies it holds), or
        ``None`` without CheckFree+."""
        if not self.plus:
            return None
        return CopyStore(self.copies_dir(job_dir, rank))

    def build_components(self, state, *, rank: int, job_dir: str) -> list:
        """The runtime components (``moe_ft/runtime/hooks.py``): with >= 3 pipeline stages (a stage can be
        rebuilt) the record of each parameter group's learning rates (a boost survives later restarts);
        with ``--ft-checkfree-plus`` also the partner swap and the copies."""
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from megatron.core import parallel_state as ps

        from moe_ft.checkfree.component import CopiesComponent, GroupLrRecord, PartnerSwapComponent

        out: list = [GroupLrRecord(state.optimizer)] if ps.get_pipeline_model_parallel_world_size() >= 3 else []
        if self.plus:
            out += [PartnerSwapComponent(state), CopiesComponent(state.model, self.copies_dir(job_dir, rank))]
        return out
