"""``moe-ft drill``'s input checks, run before anything is launched: a drill whose fault can never fire
(a rank the job does not have, an iteration it never reaches, a ``persist`` fault off the save interval)
would "pass" without testing anything, and a bad job flag would only show in a worker's log minutes later.
Every check raises ``ValueError`` naming the flag and the fix; ``moe-ft drill`` reports it on one line
(``moe_ft/cli/errors.py``).
"""

from __future__ import annotations

import math
import os
import sys
import warnings

from moe_ft.drills.cluster import NodeLoss, check_losses
from moe_ft.drills.faults import Fault


def check_counts(args, *, world_size: int) -> None:
    """The drill's own numeric flags."""
    for flag, value, low in (("--iters", args.iters, 1), ("--window", args.window, 1), ("--nodes", args.nodes, 1),
                             ("--max-restarts", args.max_restarts, 0), ("--replicas", args.replicas, 0),
                             ("--persist-interval", args.persist_interval, -1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.store_dir and os.path.exists(args.store_dir) and (not os.path.isdir(args.store_dir)
                                                            or os.listdir(args.store_dir)):
        raise ValueError(f"--store-dir {args.store_dir}: exists and is not an empty directory (the jobs would "
                         "find old points in it, and the drill deletes it when it ends): give a new or empty directory")
    if world_size % args.nodes:
        raise ValueError(f"--nodes {args.nodes} must divide the job's {world_size} ranks (1, 2 or 4 nodes)")
    if args.replicas and args.nodes < 2:
        raise ValueError("--replicas places copies on other nodes: it needs --nodes N (N >= 2)")
    if args.replicas > args.nodes - 1 >= 1:
        raise ValueError(f"--replicas {args.replicas}: only {args.nodes - 1} other node(s) can hold a replica")


def check_faults(fail: list[str], fail_node: list[str], *, nodes: int, iters: int, world_size: int):
    """Parse ``--fail`` and ``--fail-node``; returns ``(faults as canonical strings, node losses)``."""
    faults = []
    for text in fail:
        fault = Fault.parse(text)
        if fault.kind == "node":
            raise ValueError(f"--fail {text}: a node loss is scheduled with --fail-node NODE:ITER[:PHASE] "
                             "and --nodes N")
        if fault.rank >= world_size:
            raise ValueError(f"--fail {text}: rank {fault.rank} does not exist (the job has ranks 0..{world_size - 1})")
        if fault.iteration >= iters:
            raise ValueError(f"--fail {text}: iteration {fault.iteration} is never reached (--iters {iters} runs "
                             f"iterations 0..{iters - 1}); the fault would never fire")
        faults.append(str(fault))
    losses = [NodeLoss.parse(text) for text in fail_node]
    if losses and nodes < 2:
        raise ValueError("--fail-node needs --nodes N (N >= 2 simulated nodes)")
    check_losses(losses, nodes)
    for loss in losses:
        if loss.iteration >= iters:
            raise ValueError(f"--fail-node {loss}: iteration {loss.iteration} is never reached (--iters {iters})")
    return faults, losses


def check_job_flags(argv: list[str], *, world_size: int, root: str) -> None:
    """Parse and validate the job's command line here, as each of its ranks will (``pretrain_gpt_moe.py``
    with its FT and elastic flag groups), so that a bad ``--extra`` flag, a missing ``--data`` or an
    impossible ``--ft-*`` combination is reported before torchrun starts."""
    if root not in sys.path:
        sys.path.insert(0, root)

    def refuse(message: str):  # argparse's error hook: raise instead of printing usage and exiting
        raise ValueError(f"job flags: {message} (python pretrain_gpt_moe.py --help lists them)")

    with warnings.catch_warnings():  # Megatron's import-time notes (no TE/Apex) are the job's business
        warnings.simplefilter("ignore")
        # start-up time: Megatron (the job's entry script is found on ``root``, put on sys.path above)
        import pretrain_gpt_moe
        from megatron.training.arguments import args_from_namespace, build_parser
        from megatron.training.unsupported_flags import check_unsupported

        groups = pretrain_gpt_moe.extra_argument_groups()
        parser = build_parser(groups)
        parser.error = refuse
        check_unsupported(argv)  # a Megatron-LM flag with a replacement: named with it (ArgumentError)
        args_from_namespace(parser.parse_args(argv), world_size, groups)  # ArgumentError is a ValueError
