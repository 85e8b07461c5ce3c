"""Node-local snapshot store: recovery points keyed by (iteration, operator, level) in host memory
that outlives the worker process, published atomically, checksummed per entry, garbage-collected by a
retention policy. See ``docs/store.md``."""

from moe_ft.store.arena import ArenaBackend
from moe_ft.store.backend import BlobSink, FaultHook, PointWriter, StagingInfo, StoreBackend
from moe_ft.store.catalog import Catalog, Problem
from moe_ft.store.errors import CorruptEntryError, MissingEntryError, StoreError
from moe_ft.store.layouts import open_backend
from moe_ft.store.local import LocalFSBackend
from moe_ft.store.manifest import EntryRecord, PointRecord, TensorRecord
from moe_ft.store.memory import MemoryBackend
from moe_ft.store.retention import KeepAll, KeepNewestRecoverable, KeepTwoRecoverable, RetentionPolicy, TripleBuffer
from moe_ft.store.rules import (
    DenseRule,
    EntryRef,
    NewestFullRule,
    RecoveryPoint,
    RecoveryRule,
    SparseWindowRule,
    dense_complete,
    newest_recoverable,
    sparse_window_complete,
)
from moe_ft.store.store import MetaEntry, PendingPoint, SnapshotStore, StoreConfig

__all__ = [
    "ArenaBackend", "BlobSink", "Catalog", "CorruptEntryError", "DenseRule", "EntryRecord", "EntryRef", "FaultHook", "KeepAll",
    "KeepNewestRecoverable", "LocalFSBackend", "MemoryBackend", "MetaEntry", "MissingEntryError",
    "NewestFullRule", "PendingPoint", "PointRecord", "PointWriter", "Problem", "RecoveryPoint", "RecoveryRule",
    "RetentionPolicy", "SnapshotStore", "SparseWindowRule", "StagingInfo", "StoreBackend", "StoreConfig",
    "StoreError", "TensorRecord", "TripleBuffer", "dense_complete", "newest_recoverable",
    "KeepTwoRecoverable", "sparse_window_complete", "open_backend",
]
