"""CheckFree / CheckFree+ (Blagoev, Ersoy, Chen, "All is Not Lost: LLM Recovery without Checkpoints"):
rebuilding a pipeline stage that lost every copy of its state from its neighbours.

* ``average.py``  the lost stage's layers as the neighbours' average weighted by their last squared
                  gradient norms (§4.2, Alg. 1 line 3), and the baselines (uniform, copy)
* ``lr_boost.py`` 1.1x learning rate for the rebuilt stage (Alg. 1 line 4) at Megatron's per-group
                  ``max_lr``/``min_lr`` seam
* ``swap.py``     CheckFree+ out-of-order micro-batches (§4.3): which micro-batches swap, the stage orders,
                  and the ``forward_step_func`` seam
* ``copies.py``   copies of the embedding/output layers on the neighbouring stages (§4.3)
* ``swap_pp.py``  CheckFree+ with pipeline parallelism: swap partners trade layer weights
* ``config.py``   ``--ft-checkfree-plus`` (``FTConfig.checkfree``); ``component.py`` its runtime components
                  (partner swap, copies sent to the holder, per-group learning rates with each snapshot)
* ``recovery.py`` the rebuild inside a recovery: weighted average (intermediate stage), copy of the swap
                  partner + embedding/output copy (CheckFree+, first/last stage)

``docs/checkfree.md`` says where the paper is vague or differs from the authors' code, and what we built.
"""

from moe_ft.checkfree.average import (
    STRATEGIES,
    Weights,
    align_layers,
    average_layers,
    averaging_weights,
    rebuild_layers,
    squared_grad_norm,
    stage_layers,
)
from moe_ft.checkfree.copies import CopyStore, copies_held_by, copies_owned_by, copy_holders
from moe_ft.checkfree.lr_boost import LrBoost, LrBoostConfig
from moe_ft.checkfree.swap import (
    SwapForwardStep,
    is_swapped,
    layer_order,
    microbatch_orders,
    stage_order,
    swap_partner,
    swapped_microbatches,
)

__all__ = ["STRATEGIES", "CopyStore", "LrBoost", "LrBoostConfig", "SwapForwardStep", "Weights", "align_layers",
           "average_layers", "averaging_weights", "copies_held_by", "copies_owned_by", "copy_holders", "is_swapped",
           "layer_order", "microbatch_orders", "rebuild_layers", "squared_grad_norm", "stage_layers", "stage_order",
           "swap_partner", "swapped_microbatches"]
