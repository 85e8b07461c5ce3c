"""Entry point of the ``moe-ft`` console script.

Subcommands live in sibling modules; every module of ``moe_ft.cli`` that defines
``register(subparsers)`` adds its own parser and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Discovery keeps subcommands independent of each other.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import moe_ft
import moe_ft.cli as cli_pkg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-ft", description="Fault-tolerant MoE training on Megatron-Core: tools."
    )
    parser.add_argument("--version", action="version", version=f"moe-ft {moe_ft.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(cli_pkg.__path__), key=lambda m: m.name):
        if info.name == "main":
            continue
        module = importlib.import_module(f"{cli_pkg.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
