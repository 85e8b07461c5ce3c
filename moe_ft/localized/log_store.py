"""The upstream log of one rank on the node-local store (MoEvement §3.4): per iteration, the tensors this
rank *sent* to its pipeline neighbours and the results of the collectives it took part in on groups that
span pipeline stages.

Layout (``docs/localized.md``), beside the snapshot store, on its tmpfs (outlives the worker process): an
arena store (``moe_ft/store/arena.py``) at ``<store_dir>/<job>/upstream/rank<r>/`` with one point per
logged iteration, whose blobs are

    MANIFEST.json             {"iteration", "algo", "entries": {name: {"size", "checksum"}}}
    send.fwd.to<peer>         activations sent downstream, tensors "000000", "000001", ... (send order)
    send.bwd.to<peer>         gradients sent upstream
    coll.<r0>-<r1>-...        results of the collectives on the group of those global ranks, in call
                              order: tensors "<seq:06d>.<i>" (output i of call seq)

Each entry is one entry of the store's codec (``moe_ft/store/codec.py``: checksummed header and tensors);
an iteration is published by one index file (the arena's atomic publish): a reader sees all of an iteration
or none of it. The manifest names every entry's size and checksum; reading verifies both.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from moe_ft.store.arena import ArenaBackend
from moe_ft.store.backend import MANIFEST
from moe_ft.store.codec import DEFAULT_CHECKSUM, read_entry, write_entry
from moe_ft.store.errors import CorruptEntryError

FWD, BWD = "fwd", "bwd"
"""Directions: ``fwd`` activations sent to the next stage, ``bwd`` gradients sent to the previous one."""


class LogUnavailable(RuntimeError):
    """A log entry that a log-fed replay needs is missing or corrupt. Localized recovery cannot proceed
    from the logs; the caller falls back to a global replay (every stage replays its window)."""


class MissingLogEntry(LogUnavailable):
    """The entry is not in the holder's log (never written, or dropped by retention)."""


class CorruptLogEntry(LogUnavailable):
    """The entry exists but fails its checksum or cannot be decoded."""


def send_name(direction: str, peer: int) -> str:
    return f"send.{direction}.to{peer}"


def group_key(ranks: Iterable[int]) -> str:
    return "-".join(str(r) for r in ranks)


def coll_name(ranks: Iterable[int]) -> str:
    return f"coll.{group_key(ranks)}"


@dataclass
class CollectiveResult:
    """One collective call on a stage-spanning group: its function and output tensors (host copies)."""

    fn: str
    outputs: list[torch.Tensor]


@dataclass
class IterationLog:
    """What one rank logged in one iteration."""

    iteration: int
    sends: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    """``(direction, peer rank)`` → ``[(virtual stage of the sending chunk, tensor)]`` in send order."""
    collectives: dict[tuple[int, ...], list[CollectiveResult]] = field(default_factory=dict)
    """Sorted global ranks of a stage-spanning group → its calls in call order."""

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for seq in self.sends.values() for _, t in seq)
        return n + sum(t.numel() * t.element_size() for calls in self.collectives.values() for c in calls
                       for t in c.outputs)

    def entries(self) -> dict[str, tuple[dict, dict[str, torch.Tensor], dict]]:
        """name → (codec key, tensors, meta) of every entry of this iteration."""
        out = {}
        for (direction, peer), seq in sorted(self.sends.items()):
            name = send_name(direction, peer)
            out[name] = ({"iteration": self.iteration, "entry": name},
                         {f"{i:06d}": t for i, (_, t) in enumerate(seq)}, {"vstages": [v for v, _ in seq]})
        for ranks, calls in sorted(self.collectives.items()):
            name = coll_name(ranks)
            tensors = {f"{i:06d}.{j}": t for i, c in enumerate(calls) for j, t in enumerate(c.outputs)}
            out[name] = ({"iteration": self.iteration, "entry": name}, tensors,
                         {"fns": [c.fn for c in calls], "num_outputs": [len(c.outputs) for c in calls],
                          "ranks": list(ranks)})
        return out


def decode_entry(name: str, tensors: dict[str, torch.Tensor], meta: dict):
    """The inverse of :meth:`IterationLog.entries` for one entry: a send list or a collective list."""
    if name.startswith("send."):
        return [(v, tensors[f"{i:06d}"]) for i, v in enumerate(meta["vstages"])]
    return [CollectiveResult(fn, [tensors[f"{i:06d}.{j}"] for j in range(n)])
            for i, (fn, n) in enumerate(zip(meta["fns"], meta["num_outputs"]))]


def encode_blob(key: dict, tensors: dict[str, torch.Tensor], meta: dict, algo: str) -> tuple[bytes, str]:
    """One codec entry as bytes and its checksum (hex)."""
    buf = io.BytesIO()
    written = write_entry(buf.write, key, tensors, algo, meta)
    return buf.getvalue(), written.checksum


def decode_blob(data: bytes, *, checksum: str, algo: str, key: dict, where: str):
    """Verify and decode one entry's bytes (raises :class:`CorruptLogEntry` naming ``where``)."""
    try:
        entry = read_entry(io.BytesIO(data), size=len(data), checksum=checksum, algo=algo, key=key, where=where)
    except CorruptEntryError as e:
        raise CorruptLogEntry(f"{e}; the upstream log cannot feed a localized replay: fall back to a global "
                              "replay (--ft-recovery-scope global)") from None
    return entry.tensors, entry.header.get("meta", {})


class LogDir:
    """One rank's upstream log (see the module docstring): each logged iteration is a point of an arena store
    (``moe_ft/store/arena.py``) whose blobs are the entries and whose manifest is this log's. Iterations
    dropped by retention give their regions to the next ones: logging an iteration writes into tmpfs pages
    that exist already, and each entry is encoded straight into its region (no intermediate buffer)."""

    def __init__(self, root: str | os.PathLike, *, algo: str = DEFAULT_CHECKSUM) -> None:
        self.root = Path(root)
        self.algo = algo
        self._backend: ArenaBackend | None = None

    def _store(self, create: bool = False) -> ArenaBackend | None:
        """The arena of this log (``None`` when nothing was logged here and ``create`` is false)."""
        if self._backend is None:
            if not create and not (self.root / "FORMAT.json").exists():
                return None
            self._backend = ArenaBackend(self.root)
        return self._backend

    def iterations(self) -> list[int]:
        store = self._store()
        return store.list_points() if store is not None else []

    def write(self, log: IterationLog) -> int:
        """Publish ``log`` (replacing an older copy of the same iteration); returns the bytes written. A
        write that fails (e.g. the file system is full) publishes nothing and leaves nothing behind."""
        store = self._store(create=True)
        assert store is not None
        store.delete_point(log.iteration)  # a replay logs the iteration again: same bytes for an exact replay
        writer = store.begin_point(log.iteration)
        manifest, total = {}, 0
        try:
            for name, (key, tensors, meta) in log.entries().items():
                sink = writer.open_blob(name)
                try:
                    written = write_entry(sink.write, key, tensors, self.algo, meta, expect=sink.expect)
                finally:
                    sink.close()
                manifest[name] = {"size": written.nbytes, "checksum": written.checksum}
                total += written.nbytes
            writer.commit(json.dumps({"iteration": log.iteration, "algo": self.algo, "entries": manifest},
                                     sort_keys=True).encode())
        except BaseException:
            writer.abort()
            raise
        return total

    def manifest(self, iteration: int) -> dict:
        store = self._store()
        where = self.root / f"iteration {iteration}"
        try:
            if store is None:
                raise FileNotFoundError
            data = store.read_blob(iteration, MANIFEST)
        except FileNotFoundError:
            raise MissingLogEntry(
                f"upstream log {self.root} has no iteration {iteration} (dropped by retention, never written, "
                "or the node's store was lost): fall back to a global replay (--ft-recovery-scope global)") from None
        try:
            manifest = json.loads(data)
            ok = manifest["iteration"] == iteration and isinstance(manifest["entries"], dict) and manifest["algo"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptLogEntry(f"upstream log manifest of {where} is unreadable or names another iteration: "
                                  "fall back to a global replay (--ft-recovery-scope global)")
        return manifest

    def entry_names(self, iteration: int) -> list[str]:
        return sorted(self.manifest(iteration)["entries"])

    def read_raw(self, iteration: int, name: str, *, verify: bool = True) -> tuple[bytes, dict]:
        """The bytes of one entry (checksum verified unless ``verify=False``: the caller decodes them, which
        verifies) and its manifest record ``{"size", "checksum", "algo"}``."""
        manifest = self.manifest(iteration)
        where = f"{self.root} iteration {iteration} {name}"
        rec = manifest["entries"].get(name)
        try:
            if rec is None:
                raise FileNotFoundError
            data = self._store().read_blob(iteration, name)  # type: ignore[union-attr]  # manifest() found it
        except FileNotFoundError:
            raise MissingLogEntry(f"upstream log entry {where} is missing: fall back to a global replay "
                                  "(--ft-recovery-scope global)") from None
        rec = {**rec, "algo": manifest["algo"]}
        if len(data) != rec["size"]:
            raise CorruptLogEntry(f"upstream log entry {where} is {len(data)} bytes, its manifest says "
                                  f"{rec['size']}: fall back to a global replay (--ft-recovery-scope global)")
        if verify:
            decode_blob(data, checksum=rec["checksum"], algo=rec["algo"],
                        key={"iteration": iteration, "entry": name}, where=where)
        return data, rec

    def read(self, iteration: int, name: str):
        """One verified entry, decoded (a send list or a collective list)."""
        data, rec = self.read_raw(iteration, name, verify=False)
        tensors, meta = decode_blob(data, checksum=rec["checksum"], algo=rec["algo"],
                                    key={"iteration": iteration, "entry": name},
                                    where=f"{self.root} iteration {iteration} {name}")
        return decode_entry(name, tensors, meta)

    def nbytes(self, iteration: int) -> int:
        return sum(r["size"] for r in self.manifest(iteration)["entries"].values())

    def drop_before(self, iteration: int) -> list[int]:
        """Delete every logged iteration older than ``iteration`` (retention) and what killed writers left
        behind; returns the iterations deleted."""
        doomed = [it for it in self.iterations() if it < iteration]
        store = self._store()
        for it in doomed:
            store.delete_point(it)  # type: ignore[union-attr]  # iterations() listed them
        if store is not None:
            store.sweep_staging()
        return doomed

    def drop_after(self, iteration: int) -> list[int]:
        """Delete every logged iteration newer than ``iteration`` (an abandoned timeline after a rollback)."""
        doomed = [it for it in self.iterations() if it > iteration]
        for it in doomed:
            self._store().delete_point(it)  # type: ignore[union-attr]
        return doomed

    def location(self, iteration: int, name: str) -> tuple[str, int, int]:
        """Where an entry's bytes lie (file, offset, length): what a ``corrupt-log`` fault damages."""
        store = self._store()
        if store is None:
            raise FileNotFoundError(f"no upstream log in {self.root}")
        return store.blob_location(iteration, name)
