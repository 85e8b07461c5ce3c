"""Entry point of the ``moe-ft`` console script (also ``python -m moe_ft``).

Subcommands live in sibling modules; every module of ``moe_ft.cli`` that defines
``register(subparsers)`` adds its own parser and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Discovery keeps subcommands independent of each other.

Startup stays fast (``moe-ft --help`` well under a second): building the parsers imports no torch or
Megatron (numpy, ~40 ms, comes with ``moe-ft placement``'s arithmetic); each subcommand imports its heavy
modules inside ``func`` (``tests/test_cli_main.py`` holds every module to that). User errors print one line and exit 2 (``moe_ft/cli/errors.py``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import moe_ft
import moe_ft.cli as cli_pkg
from moe_ft.cli.errors import CliParser, UsageError, report


def subcommand_modules() -> list[str]:
    """The modules of ``moe_ft.cli`` other than this one, in name order."""
    return [f"{cli_pkg.__name__}.{info.name}" for info in sorted(pkgutil.iter_modules(cli_pkg.__path__),
                                                                 key=lambda m: m.name) if info.name != "main"]


def build_parser() -> CliParser:
    parser = CliParser(prog="moe-ft", description="Fault-tolerant MoE training on Megatron-Core: tools.")
    parser.add_argument("--version", action="version", version=f"moe-ft {moe_ft.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in subcommand_modules():
        register = getattr(importlib.import_module(name), "register", None)
        if register is not None:
            register(subparsers)
    return parser


def passthrough(command: str):
    """``passthrough(argv)`` of the subcommand module named ``command``, if it takes its command line as
    is (``moe-ft launch``: torchrun's flags go to the launcher's own parser), else ``None``."""
    for name in subcommand_modules():
        if name.rsplit(".", 1)[1] == command:
            return getattr(importlib.import_module(name), "passthrough", None)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    direct = passthrough(argv[0]) if argv else None
    if direct is not None:
        return int(direct(argv[1:]) or 0)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage error already reported on one line
        return done.code if isinstance(done.code, int) else 0
    # A subcommand that runs may import Megatron-Core: its expected warnings are held back (megatron/training/
    # quiet.py). start-up time: --help imports nothing of Megatron.
    from megatron.training.quiet import hold

    hold()
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        return report(args.command, exc)
    except KeyboardInterrupt:
        print(f"moe-ft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
