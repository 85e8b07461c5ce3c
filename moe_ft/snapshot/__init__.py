"""Snapshot engine: executes a snapshot plan into the node-local store without stalling training.
See ``docs/snapshot.md``."""

from moe_ft.snapshot.engine import EngineConfig, SnapshotEngine, SnapshotRecord
from moe_ft.snapshot.restore import restore_meta, restore_operator

__all__ = ["EngineConfig", "SnapshotEngine", "SnapshotRecord", "restore_meta", "restore_operator"]
