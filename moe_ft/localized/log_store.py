"""The upstream log of one rank on the node-local store (MoEvement §3.4): per iteration, the tensors this
rank *sent* to its pipeline neighbours and the results of the collectives it took part in on groups that
span pipeline stages.

Layout (``docs/localized.md``), beside the snapshot store, on its tmpfs (outlives the worker process)::

    <store_dir>/<job>/upstream/rank<r>/it<iteration:012d>/
        MANIFEST.json             {"iteration", "algo", "entries": {name: {"size", "checksum"}}}
        send.fwd.to<peer>         activations sent downstream, tensors "000000", "000001", ... (send order)
        send.bwd.to<peer>         gradients sent upstream
        coll.<r0>-<r1>-...        results of the collectives on the group of those global ranks, in call
                                  order: tensors "<seq:06d>.<i>" (output i of call seq)
    <...>/.staging/...            iterations being written (or left by a killed writer)

Each file is one entry of the store's codec (``moe_ft/store/codec.py``: checksummed header and tensors);
an iteration is written into ``.staging`` and renamed into place in one ``rename(2)``: a reader sees all
of an iteration or none of it. The manifest names every entry's size and checksum; reading verifies both.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from moe_ft.store.codec import DEFAULT_CHECKSUM, read_entry, write_entry
from moe_ft.store.errors import CorruptEntryError

MANIFEST = "MANIFEST.json"
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
    """One rank's upstream log directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, *, algo: str = DEFAULT_CHECKSUM) -> None:
        self.root = Path(root)
        self.algo = algo

    def _it_dir(self, iteration: int) -> Path:
        return self.root / f"it{iteration:012d}"

    def iterations(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[2:]) for p in self.root.iterdir() if p.name.startswith("it") and p.name[2:].isdigit())

    def write(self, log: IterationLog) -> int:
        """Publish ``log`` (replacing an older copy of the same iteration); returns the bytes written. A
        write that fails (e.g. the file system is full) leaves no staging behind and publishes nothing."""
        staging = self.root / ".staging" / f"it{log.iteration:012d}.{os.getpid()}"
        try:
            return self._write(log, staging)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _write(self, log: IterationLog, staging: Path) -> int:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        manifest, total = {}, 0
        for name, (key, tensors, meta) in log.entries().items():
            data, checksum = encode_blob(key, tensors, meta, self.algo)
            (staging / name).write_bytes(data)
            manifest[name] = {"size": len(data), "checksum": checksum}
            total += len(data)
        (staging / MANIFEST).write_text(json.dumps({"iteration": log.iteration, "algo": self.algo,
                                                    "entries": manifest}, sort_keys=True))
        final = self._it_dir(log.iteration)
        if final.exists():  # a replay logs the iteration again: same bytes for an exact replay
            old = self.root / ".staging" / f"old.{log.iteration:012d}.{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(staging, final)
        return total

    def manifest(self, iteration: int) -> dict:
        path = self._it_dir(iteration) / MANIFEST
        if not path.is_file():
            raise MissingLogEntry(
                f"upstream log {self._it_dir(iteration)} has no iteration {iteration} (dropped by retention, "
                "never written, or the node's store was lost): fall back to a global replay "
                "(--ft-recovery-scope global)")
        try:
            manifest = json.loads(path.read_text())
            ok = manifest["iteration"] == iteration and isinstance(manifest["entries"], dict) and manifest["algo"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptLogEntry(f"upstream log manifest {path} is unreadable or names another iteration: fall "
                                  "back to a global replay (--ft-recovery-scope global)")
        return manifest

    def entry_names(self, iteration: int) -> list[str]:
        return sorted(self.manifest(iteration)["entries"])

    def read_raw(self, iteration: int, name: str, *, verify: bool = True) -> tuple[bytes, dict]:
        """The bytes of one entry (checksum verified unless ``verify=False``: the caller decodes them, which
        verifies) and its manifest record ``{"size", "checksum", "algo"}``."""
        manifest = self.manifest(iteration)
        path = self._it_dir(iteration) / name
        rec = manifest["entries"].get(name)
        if rec is None or not path.is_file():
            raise MissingLogEntry(f"upstream log entry {path} is missing (iteration {iteration}): fall back to "
                                  "a global replay (--ft-recovery-scope global)")
        data = path.read_bytes()
        rec = {**rec, "algo": manifest["algo"]}
        if len(data) != rec["size"]:
            raise CorruptLogEntry(f"upstream log entry {path} is {len(data)} bytes, its manifest says "
                                  f"{rec['size']}: fall back to a global replay (--ft-recovery-scope global)")
        if verify:
            decode_blob(data, checksum=rec["checksum"], algo=rec["algo"],
                        key={"iteration": iteration, "entry": name}, where=str(path))
        return data, rec

    def read(self, iteration: int, name: str):
        """One verified entry, decoded (a send list or a collective list)."""
        data, rec = self.read_raw(iteration, name, verify=False)
        tensors, meta = decode_blob(data, checksum=rec["checksum"], algo=rec["algo"],
                                    key={"iteration": iteration, "entry": name}, where=str(self._it_dir(iteration) / name))
        return decode_entry(name, tensors, meta)

    def nbytes(self, iteration: int) -> int:
        return sum(r["size"] for r in self.manifest(iteration)["entries"].values())

    def drop_before(self, iteration: int) -> list[int]:
        """Delete every logged iteration older than ``iteration`` (retention) and what killed writers left in
        ``.staging``; returns the iterations deleted."""
        doomed = [it for it in self.iterations() if it < iteration]
        for it in doomed:
            shutil.rmtree(self._it_dir(it), ignore_errors=True)
        staging = self.root / ".staging"
        if staging.is_dir():
            mine = f".{os.getpid()}"
            for leftover in staging.iterdir():
                if not leftover.name.endswith(mine):  # one writing process per rank directory
                    shutil.rmtree(leftover, ignore_errors=True)
        return doomed

    def drop_after(self, iteration: int) -> list[int]:
        """Delete every logged iteration newer than ``iteration`` (an abandoned timeline after a rollback)."""
        doomed = [it for it in self.iterations() if it > iteration]
        for it in doomed:
            shutil.rmtree(self._it_dir(it), ignore_errors=True)
        return doomed
