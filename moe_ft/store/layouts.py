"""Which backend a store directory holds: the arena (``moe_ft.store.arena``, the default for node-local
stores) or a directory of files per point (``moe_ft.store.local``, the durable tier's and the former
default). A directory that exists is opened as what its ``FORMAT.json`` says, whatever was asked, so
stores written by either stay readable."""

from __future__ import annotations

import os
from pathlib import Path

from moe_ft.store.arena import ArenaBackend
from moe_ft.store.backend import FaultHook, StoreBackend, read_format
from moe_ft.store.local import LocalFSBackend

LAYOUTS = ("arena", "files")


def layout_of(directory: str | os.PathLike) -> str | None:
    """``"arena"``, ``"files"``, or ``None`` when ``directory`` holds no store yet."""
    try:
        found = read_format(Path(directory) / "FORMAT.json")
    except FileNotFoundError:
        return None
    return "arena" if found.get("layout") == "arena" else "files"


def open_backend(directory: str | os.PathLike, *, layout: str = "arena", create: bool = True, fsync: bool = False,
                 fault_hook: FaultHook | None = None, recycle: bool = False, initial_bytes: int = 0) -> StoreBackend:
    """The backend of ``directory``: its existing layout, else a new store of ``layout``. ``recycle``
    applies to the file layout (the arena reuses its regions anyway), ``initial_bytes`` to the arena (its
    first segment: the capacity check's estimate, so that a store usually needs no second one)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown store layout {layout!r}; choose one of {LAYOUTS}")
    found = layout_of(directory) or layout
    if found == "arena":
        return ArenaBackend(directory, fsync=fsync, fault_hook=fault_hook, create=create, initial_bytes=initial_bytes)
    return LocalFSBackend(directory, fsync=fsync, fault_hook=fault_hook, create=create, recycle=recycle)
