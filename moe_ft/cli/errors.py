"""User errors of the ``moe-ft`` command line: one line on stderr, exit status 2, never a traceback.

A user error is a mistake the user can fix from the message: a bad flag value, a missing or unreadable
input file, a combination that cannot work. Subcommands raise :class:`UsageError` (or wrap the input
checks in :func:`user_input`, which turns ``ValueError``/``OSError`` into one) and register their function
through :func:`reporting`, which prints ``moe-ft <subcommand>: error: <message>`` and returns 2 (``main``
does the same for any that escapes). Anything else is a bug and keeps its traceback. :class:`CliParser`
gives argparse's own errors the same one-line form.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from typing import Callable, Iterator

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in the command line or its inputs; the message names it and the fix."""


def one_line(message: object) -> str:
    """``message`` without line breaks (an exception text may span lines; the report is one line)."""
    return " ".join(str(message).split())


@contextlib.contextmanager
def user_input(*types: type[BaseException]) -> Iterator[None]:
    """Inside the block, ``types`` (default ``ValueError`` and ``OSError``: bad values, missing or
    unreadable files) are user errors. Use it around input parsing and checks only, not around the work
    itself, where the same exceptions would be bugs."""
    try:
        yield
    except types or (ValueError, OSError) as exc:
        raise UsageError(one_line(exc) or type(exc).__name__) from exc


class CliParser(argparse.ArgumentParser):
    """argparse with the one-line error report: ``<prog>: error: <message> (see <prog> --help)``."""

    def error(self, message: str):  # argparse's hook; never returns
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def report(command: str | None, exc: UsageError) -> int:
    prog = f"moe-ft {command}" if command else "moe-ft"
    print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
    return EXIT_USAGE


def reporting(command: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``func`` (a subcommand's ``run(args) -> exit code``) with its :class:`UsageError` reported on one
    line and turned into exit code 2; what ``set_defaults(func=...)`` takes."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except UsageError as exc:
            return report(command, exc)

    return run
