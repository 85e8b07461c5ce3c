"""Megatron-Core's and torch's expected warnings, held back and summed up in one line on rank 0.

Without Transformer Engine and Apex (every CPU run, and GPU machines without them) Megatron-Core warns of its
fallbacks at import time in every module that has one, in every rank: about 30 lines per job start that say
nothing a user can act on. :func:`hold` installs a ``warnings.showwarning`` hook (and a filter on Megatron-Core's
logger) that keeps the known ones instead of printing them; :func:`summary` is the one line rank 0 prints
instead; ``--verbose`` (:func:`release`) prints what was held and every later one as it comes. Warnings not
listed here are printed as always.

Call :func:`hold` before the first import of ``megatron.core`` (the entry script does it first thing).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """One kind of expected warning: what it means in the summary line, and how to recognise it."""

    meaning: str
    pattern: re.Pattern


KNOWN = (
    Known("Transformer Engine and Apex absent: Megatron-Core's torch fallbacks",
          re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")),
    Known("deprecated calls inside Megatron-Core and torch",
          re.compile(r"full scope is deprecated|`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                     r"is deprecated")),
    Known("moe-ft's MoE layer takes Megatron-Core's default process groups",
          re.compile(r"Unknown MLP type: ")),
    Known("set CUDA_DEVICE_MAX_CONNECTIONS=1 for sequence parallelism's speed on GPUs",
          re.compile(r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1")),
)
"""The expected warnings (``pattern`` searched in the message)."""

LOGGERS = ("megatron.core.transformer.transformer_layer",)
"""Megatron-Core's loggers that log an expected warning (a logger's filters see only its own records, not its
children's)."""

_held: list = []  # (Known, warnings.WarningMessage | logging.LogRecord)
_state = {"installed": False, "verbose": False}
_show_original = warnings.showwarning


def _known(text: str) -> Known | None:
    return next((k for k in KNOWN if k.pattern.search(text)), None)


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    known = None if _state["verbose"] else _known(str(message))
    if known is None:
        _show_original(message, category, filename, lineno, file, line)
    else:
        _held.append((known, warnings.WarningMessage(message, category, filename, lineno, file, line)))


class _LogFilter(logging.Filter):
    """Megatron-Core logs some of its fallbacks (``log_single_rank``) instead of warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        known = None if _state["verbose"] else _known(record.getMessage())
        if known is not None:
            _held.append((known, record))
        return known is None


def hold() -> None:
    """Keep the known warnings from now on (idempotent)."""
    global _show_original
    if _state["installed"]:
        return
    _state["installed"] = True
    _show_original = warnings.showwarning
    warnings.showwarning = _show
    for name in LOGGERS:
        logging.getLogger(name).addFilter(_LogFilter())


def release() -> None:
    """``--verbose``: print what was held, and every known warning as it comes from now on."""
    _state["verbose"] = True
    held, _held[:] = list(_held), []
    for _, item in held:
        if isinstance(item, logging.LogRecord):
            logging.getLogger(item.name).handle(item)
        else:
            _show_original(item.message, item.category, item.filename, item.lineno, item.file, item.line)


def held_count() -> int:
    return len(_held)


def summary() -> str | None:
    """One line naming what the held warnings said (``None``: nothing held)."""
    if not _held:
        return None
    counts = Counter(known.meaning for known, _ in _held)
    parts = "; ".join(f"{meaning} ({n})" for meaning, n in counts.items())
    return f"expected warnings held back: {parts}; --verbose prints them"
