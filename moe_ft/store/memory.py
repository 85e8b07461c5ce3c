"""In-process backend: points live in a dict. It does not outlive the process, so it is not a node-local
store; it exists for tests of other components (snapshot engine, recovery) and as the second
implementation that keeps :class:`StoreBackend` honest."""

from __future__ import annotations

import io
import itertools
import os
import threading
from typing import Any, BinaryIO

from moe_ft.store.backend import MANIFEST, BlobSink, FaultHook, PointWriter, StagingInfo, StoreBackend


class _MemorySink(BlobSink):
    def __init__(self, writer: "_MemoryWriter", name: str) -> None:
        self._writer, self._name = writer, name
        self._parts: list[bytes] = []

    def write(self, buf: Any) -> None:
        self._parts.append(bytes(buf))  # copy: the caller may reuse its buffer
        self._writer.backend._hook("blob_write", self._writer.iteration, self._name)

    def close(self) -> None:
        with self._writer.backend._lock:
            self._writer.blobs[self._name] = b"".join(self._parts)
        self._parts = []
        self._writer.backend._hook("blob_closed", self._writer.iteration, self._name)


class _MemoryWriter(PointWriter):
    def __init__(self, backend: "MemoryBackend", iteration: int, token: int) -> None:
        self.backend, self.iteration, self.token = backend, iteration, token
        self.blobs: dict[str, bytes] = {}

    def open_blob(self, name: str) -> BlobSink:
        if name == MANIFEST:
            raise ValueError(f"blob name {MANIFEST!r} is reserved for the manifest")
        return _MemorySink(self, name)

    def commit(self, manifest: bytes) -> None:
        backend = self.backend
        with backend._lock:
            if self.token not in backend._staging:
                raise RuntimeError(f"point {self.iteration} was aborted or already committed")
            if self.iteration in backend._points:
                raise FileExistsError(f"point {self.iteration} is already published in {backend.describe()}")
            self.blobs[MANIFEST] = bytes(manifest)
        backend._hook("before_commit", self.iteration, "")
        with backend._lock:
            if self.iteration in backend._points:
                raise FileExistsError(f"point {self.iteration} is already published in {backend.describe()}")
            backend._points[self.iteration] = dict(self.blobs)
            del backend._staging[self.token]
        backend._hook("after_commit", self.iteration, "")

    def abort(self) -> None:
        with self.backend._lock:
            self.backend._staging.pop(self.token, None)
        self.blobs = {}


class MemoryBackend(StoreBackend):
    def __init__(self, *, name: str = "memory", fault_hook: FaultHook | None = None) -> None:
        self._name = name
        self._fault_hook = fault_hook
        self._lock = threading.Lock()
        self._points: dict[int, dict[str, bytes]] = {}
        self._staging: dict[int, _MemoryWriter] = {}
        self._tokens = itertools.count()

    def _hook(self, phase: str, iteration: int, name: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase, iteration, name)

    def describe(self) -> str:
        return f"<{self._name}>"

    def begin_point(self, iteration: int) -> PointWriter:
        writer = _MemoryWriter(self, iteration, next(self._tokens))
        with self._lock:
            self._staging[writer.token] = writer
        return writer

    def list_points(self) -> list[int]:
        with self._lock:
            return sorted(self._points)

    def list_staging(self) -> list[StagingInfo]:
        with self._lock:
            return [StagingInfo(w.iteration, f"staging-{t}", sum(map(len, w.blobs.values())), os.getpid(), True)
                    for t, w in sorted(self._staging.items())]

    def _point(self, iteration: int) -> dict[str, bytes]:
        with self._lock:
            point = self._points.get(iteration)
        if point is None:
            raise FileNotFoundError(f"no published point {iteration} in {self.describe()}")
        return point

    def blob_names(self, iteration: int) -> list[str]:
        return sorted(self._point(iteration))

    def blob_size(self, iteration: int, name: str) -> int | None:
        with self._lock:
            blob = self._points.get(iteration, {}).get(name)
        return None if blob is None else len(blob)

    def open_blob(self, iteration: int, name: str) -> BinaryIO:
        blob = self._point(iteration).get(name)
        if blob is None:
            raise FileNotFoundError(f"no blob {name!r} in point {iteration} of {self.describe()}")
        return io.BytesIO(blob)

    def add_blob(self, iteration: int, name: str, data: bytes) -> None:
        with self._lock:
            point = self._points.get(iteration)
            if point is None:
                raise FileNotFoundError(f"no published point {iteration} in {self.describe()}")
            if name in point:
                raise FileExistsError(f"blob {name!r} exists in point {iteration} of {self.describe()}")
            point[name] = bytes(data)

    def delete_point(self, iteration: int) -> None:
        with self._lock:
            self._points.pop(iteration, None)

    def sweep_staging(self) -> int:
        return 0  # every writer lives in this process; their staging dies with it
