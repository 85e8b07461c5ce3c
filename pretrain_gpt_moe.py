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

import faulthandler
import gc
import signal
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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    from megatron.training.arguments import ArgumentError, parse_args
    from moe_ft.launch.protocol import USAGE_EXIT_CODE

    try:
        args = parse_args(argv, extra_groups=extra_argument_groups())  # validated before any process-group work
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE

    from megatron.training.pretrain import pretrain
    from moe_ft.compat import activate_all

    try:  # the CPU layer (before process groups and the model) and the writer shim (before the first save)
        activate_all()
    except RuntimeError as e:  # a Megatron-Core version the shims were not written for
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    from moe_ft.launch.protocol import GAVE_UP_EXIT_CODE
    from moe_ft.launch.worker import join

    membership = join()  # under moe-ft launch a spare waits here, imports done, until it is given a rank
    while True:
        hooks = step_hooks(args)
        if hooks is None:
            pretrain(args)
            return 0
        code, failure = _train_guarded(args, hooks, membership)
        if code == 0:
            return 0
        hooks.abandon()  # this attempt's threads and files; the process groups are gone already
        del hooks
        _free_device_memory()
        if not membership.rejoin(*failure):
            return GAVE_UP_EXIT_CODE if membership.gave_up else code  # gave up: the agent restarts everyone
        # a peer failed and the agent replaced it: train again in this process (recovery follows), from
        # freshly parsed flags: the configs in args.extra keep per-start decisions (e.g. --ft-elastic's plan)
        args = parse_args(argv, extra_groups=extra_argument_groups())


def _free_device_memory() -> None:
    """The failed attempt's model and optimizer are unreachable now; on a GPU collect them before the next
    attempt allocates its own. On CPU the collector reclaims them later: a full collection costs ~0.35 s of
    the survivors' way back (measured on the tiny PP=4 drill), and their connections are already shut down."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _train_guarded(args, hooks, membership) -> tuple[int, tuple[str, bool]]:
    """One attempt: ``(exit code, (error message, whether a peer caused it))``. In an in-process attempt
    after the first, every process (survivor or spare) waits at most ``--reform-timeout`` for the others
    to form the new process group (a rank that never arrives ends the attempt; the agent then restarts
    the whole group)."""
    from megatron.training.pretrain import pretrain
    from moe_ft.launch.protocol import reform_timeout_s
    from moe_ft.launch.worker import peer_failure, sever_peer_connections
    from moe_ft.localized.survivor import run_guarded

    failure = ("", False)

    def on_failure(exc: BaseException) -> None:
        nonlocal failure
        failure = (f"{type(exc).__name__}: {exc}", peer_failure(exc))  # no reference to the frames
        if failure[1] and membership.inprocess:
            sever_peer_connections()  # the failed attempt's operations fail everywhere, none waits
            membership.suspect()

    # a stopped or failing rank publishes its state (survivor point) before it exits non-zero
    join = reform_timeout_s() if membership.inprocess and membership.attempt > 0 else None
    code = run_guarded(lambda: pretrain(args, hooks=hooks, join_timeout_s=join), lambda: hooks.survivor, on_failure)
    return code, failure


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    sys.exit(main())
