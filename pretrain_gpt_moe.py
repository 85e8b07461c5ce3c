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

import contextlib
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


def step_hooks(args, membership=None, carried=None):
    """The per-iteration hooks of the training loop (``megatron.training.training.StepHooks``): where
    the fault-tolerance runtime plugs in. ``None`` runs plain Megatron training. Under ``moe-ft launch``:
    ``membership`` (this process's place in the job: whether the agents ask it to regroup) and ``carried``
    (the survivor point it held when its previous attempt failed)."""
    from moe_ft.runtime.hooks import build_runtime

    regroup = membership.regroup_requested if membership is not None and membership.inprocess else None
    return build_runtime(args, carried, regroup=regroup)


def main(argv=None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
    from megatron.training.quiet import hold

    hold()  # before Megatron-Core's first import: its expected warnings become one line (--verbose: all)
    from megatron.training.deferred_compile import import_megatron_core

    import_megatron_core()  # its torch.compile'd fusions wrapped at their first call: ~2 s less CPU per start
    from megatron.training.arguments import ArgumentError, parse_args
    from moe_ft.launch.protocol import USAGE_EXIT_CODE

    try:
        args = parse_args(argv, extra_groups=extra_argument_groups())  # validated before any process-group work
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE

    from moe_ft.compat import activate_all

    try:  # the CPU layer (before process groups and the model) and the writer shim (before the first save)
        activate_all()
    except RuntimeError as e:  # a Megatron-Core version the shims were not written for
        print(f"error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    from moe_ft.launch.worker import join
    from moe_ft.localized.survivor import AttemptStop

    membership = join()  # under moe-ft launch a spare waits here, imports done, until it is given a rank
    stop = AttemptStop()
    # under moe-ft launch, once around every attempt: a SIGTERM between two (the agent stops the workers)
    # makes the process leave with what it holds written, never the default death that loses it
    with stop.installed() if membership.inprocess else contextlib.nullcontext():
        return _attempts(argv, args, membership, stop)


def _attempts(argv, args, membership, stop) -> int:
    """Train, and under ``moe-ft launch`` train again in this process after each failure the agents
    replaced. A SIGTERM outside an attempt (the agent stops the workers) makes the process leave, after
    writing the state it holds; while it closes a failed attempt, once that is done."""
    from megatron.training.arguments import parse_args
    from moe_ft.elastic import standby
    from moe_ft.launch.protocol import GAVE_UP_EXIT_CODE
    from moe_ft.localized.survivor import SurvivorStop

    held = None  # a survivor's state of its last completed iteration, kept in memory across attempts
    code = 1
    try:
        while True:
            left_out = standby.enter(args, membership)  # --ft-elastic: the global batch may leave this rank out
            if left_out is not None:
                return left_out
            hooks = step_hooks(args, membership, held)
            if hooks is None:
                _pretrain(args)
                return 0
            code, failure = _train_guarded(args, hooks, membership)
            if code == 0:
                standby.mark_done(args, membership)
                return 0
            held = hooks.survivor_point()
            with stop.deferred():
                hooks.abandon()  # this attempt's threads and files; the process groups are gone already
                del hooks
                _free_device_memory()
            rejoined = membership.rejoin(*failure)  # waits for the agent's next attempt
            if held is not None and (not rejoined or membership.resized):
                _spill(held)  # a process restart, or a reshaped job's new ranks, read it in the node store
                held = None
            if not rejoined:
                return GAVE_UP_EXIT_CODE if membership.gave_up else code  # gave up: the agent restarts everyone
            # a peer failed and the agent replaced it: train again in this process (recovery follows), from
            # freshly parsed flags: the configs in args.extra keep per-start decisions (e.g. --ft-elastic's plan)
            args = parse_args(argv, extra_groups=extra_argument_groups())
    except SurvivorStop as e:
        print(f"moe-ft launch: rank {membership.rank} leaves: {e}", file=sys.stderr, flush=True)
        if held is not None:
            _spill(held)
        return code


def _pretrain(args, **kwargs):
    """``pretrain``, with flags that do not fit the data (an ``ArgumentError`` of its start-up checks: a token
    id beyond the vocabulary) ending the process with one line and exit 2, as a bad flag does at parsing.
    ``SystemExit`` is no ``Exception``: a guarded attempt does not publish and print a traceback for it, and
    ``moe-ft launch``'s agent stops the job rather than give the rank to a spare that would stop the same way."""
    from megatron.training.arguments import ArgumentError  # start-up time: after Megatron-Core's quiet import
    from megatron.training.pretrain import pretrain
    from moe_ft.launch.protocol import USAGE_EXIT_CODE

    try:
        return pretrain(args, **kwargs)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT_CODE) from None


def _spill(held) -> None:
    """Write the survivor point this process held into its node store, a SIGTERM ignored meanwhile (the
    agent's SIGKILL follows only after its grace period)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        result = held.spill()
        print(f"moe-ft survivor: rank {held.rank} published its state at iteration {result.iteration} "
              f"({result.nbytes / 1e6:.1f} MB in {result.seconds:.2f} s), held in memory until it left or the "
              "job was reshaped", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the rank then counts as failed in the next recovery
        print(f"moe-ft survivor: rank {held.rank} could not write its held state: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    the whole group, whose fresh processes wait as long as at a first start)."""
    from moe_ft.launch.protocol import reform_timeout_s
    from moe_ft.launch.worker import peer_failure, sever_peer_connections
    from moe_ft.localized.survivor import Regroup, run_guarded

    failure = ("", False)

    def on_failure(exc: BaseException) -> None:
        nonlocal failure
        regroup = isinstance(exc, Regroup)  # a node joins: every rank left at the same iteration, all stay
        failure = (f"{type(exc).__name__}: {exc}", peer_failure(exc) or regroup)  # no reference to the frames
        if failure[1] and membership.inprocess:
            sever_peer_connections()  # the failed attempt's operations fail everywhere, none waits
            if not regroup:
                membership.suspect()

    # a stopped or failing rank publishes its state (survivor point) before it exits non-zero, or holds it
    join = reform_timeout_s() if membership.reforming else None
    code = run_guarded(lambda: _pretrain(args, hooks=hooks, join_timeout_s=join), lambda: hooks.survivor, on_failure,
                       hold=membership.inprocess)  # a process that may stay keeps its point in memory
    return code, failure


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    sys.exit(main())
