"""``moe-ft launch``: torchrun's flags, warm spares, survivors that keep their processes (``moe_ft/launch/``).

    moe-ft launch --standalone --nproc-per-node 4 --spares-per-node 1 pretrain_gpt_moe.py --ft ...

Everything after ``launch`` goes to the launcher's own parser (torchrun's, plus ``--spares-per-node``,
``--reform-timeout``, ``--full-restart``, ``--preload``); ``moe-ft launch --help`` lists them.
"""

from __future__ import annotations

import argparse

from moe_ft.cli.errors import reporting


def passthrough(argv: list[str]) -> int:
    """The whole command line after ``launch`` goes to the launcher (``moe_ft/cli/main.py`` calls this
    before its own parser, so ``moe-ft launch --help`` is the launcher's help)."""
    # start-up time: the launcher imports torch; `moe-ft --help` must not
    from moe_ft.launch.cli import main

    return int(main(argv) or 0)


def run(args) -> int:
    return passthrough(list(args.launch_args))


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", add_help=False,
                              help="torchrun that replaces only failed workers, from warm spares (docs/launch.md)")
    p.add_argument("launch_args", nargs=argparse.REMAINDER,
                   help="torchrun's flags, --spares-per-node N, --reform-timeout S, then the script and its flags")
    p.set_defaults(func=reporting("launch", run))
