"""Pretrain a Mixture-of-Experts GPT on Megatron-Core.

    torchrun --nproc-per-node 4 pretrain_gpt_moe.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 100 --lr 3e-3 --data-path data/corpus --save runs/ckpt --save-interval 50

Parse -> build -> train -> clean up. Flags are Megatron-LM's; ``--help`` lists them. The training loop
(``megatron/training``) does not import ``moe_ft``: this script activates the compatibility shims
(``moe_ft.compat.activate_all``: CPU layer, checkpoint writer) and plugs the fault-tolerance runtime into
the loop's hooks.
"""

from __future__ import annotations

import sys


def extra_argument_groups():
    """(title, config dataclass) of every moe-ft component that adds flags; one flag per field."""
    from moe_ft.config import FTConfig
    from moe_ft.elastic.config import ElasticConfig
    from moe_ft.precision.emulation import FP8EmulationConfig

    return [("FP8 emulation", FP8EmulationConfig), ("elastic expert placement (Lazarus)", ElasticConfig),
            ("fault tolerance", FTConfig)]


def step_hooks(args):
    """The per-iteration hooks of the training loop (``megatron.training.training.StepHooks``): where
    the fault-tolerance runtime plugs in. ``None`` runs plain Megatron training."""
    from moe_ft.runtime.hooks import build_runtime

    return build_runtime(args)


def main(argv=None) -> int:
    from megatron.training.arguments import ArgumentError, parse_args

    try:
        args = parse_args(argv, extra_groups=extra_argument_groups())  # validated before any process-group work
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from megatron.training.pretrain import pretrain
    from moe_ft.compat import activate_all

    try:  # the CPU layer (before process groups and the model) and the writer shim (before the first save)
        activate_all()
    except RuntimeError as e:  # a Megatron-Core version the shims were not written for
        print(f"error: {e}", file=sys.stderr)
        return 2
    hooks = step_hooks(args)
    if hooks is None:
        pretrain(args)
        return 0
    from moe_ft.localized.survivor import run_guarded

    # a stopped or failing rank publishes its state (survivor point) before it exits non-zero
    return run_guarded(lambda: pretrain(args, hooks=hooks), lambda: hooks.survivor)


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    sys.exit(main())
