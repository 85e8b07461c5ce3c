"""Exceptions of the node-local store. Every error names the store location and the entry involved, so
that an operator reading a log line knows which file to look at."""

from __future__ import annotations

import errno


class StoreError(RuntimeError):
    """Base class of every error raised by :mod:`moe_ft.store`."""


class CorruptEntryError(StoreError):
    """An entry (or a manifest) failed verification: bad magic, wrong size, checksum mismatch, or a header
    that does not match the key it is stored under. Its bytes were not returned to the caller."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"corrupt store entry {where}: {reason}")
        self.where = where
        self.reason = reason


class MissingEntryError(StoreError, KeyError):
    """The requested recovery point or entry is not in the store (never published, or garbage-collected)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "missing store entry"


def store_full(error: BaseException) -> bool:
    """Whether ``error`` says the store's file system has no room (``ENOSPC``, or a quota: ``EDQUOT``): the
    writers of per-iteration state skip and go on instead of ending the run."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
