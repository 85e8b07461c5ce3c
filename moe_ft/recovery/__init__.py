"""Recovery after a failure: agreement on a recovery point, sparse-to-dense replay (exact),
dense restore, lossy restore with token-loss accounting. See ``docs/recovery.md``.

The names below load on first use (PEP 562): ``moe_ft.recovery.config`` is read at flag parsing, which must
not import the recovery machine (Megatron-Core's model code)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"MachineConfig": "machine", "Phase": "machine", "Recovery": "machine", "RecoveryContext": "machine",
            "RecoveryState": "machine", "RecoveryReport": "report"}

__all__ = ["Phase", "Recovery", "MachineConfig", "RecoveryContext", "RecoveryReport", "RecoveryState"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_ft.recovery' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moe_ft.recovery.{module}"), name)
