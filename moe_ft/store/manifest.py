"""Manifest of a published point: which entries it holds, their sizes and checksums, and the tensor
tables. It is JSON (human-readable with ``cat``) and carries its own checksum, computed over the canonical
encoding of everything else, so that a damaged manifest is detected rather than trusted."""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.codec import (
    EntryLayout,
    WrittenEntry,
    key_rest,
    new_checksum,
    seal_entry,
    sealed_head,
    templated_head,
)
from moe_ft.store.errors import CorruptEntryError

FORMAT = "moe-ft-store/1"
META_BLOB = "_meta.ent"  # operator names never start with "_"


@functools.lru_cache(maxsize=1 << 14)
def entry_blob(op: OperatorId, level: Level) -> str:
    """The blob name of ``op``'s entry at ``level`` (remembered: every snapshot names its entries)."""
    return f"{op}.{level.name.lower()}.ent"


def entry_key(iteration: int, op: OperatorId | None, level: Level | None) -> dict[str, Any]:
    """The key recorded inside an entry's header (and compared on load)."""
    if op is None:
        return {"iteration": iteration, "kind": "meta"}
    assert level is not None, "an operator's entry has a level"
    return {"iteration": iteration, "operator": str(op), "level": level.name}


@functools.lru_cache(maxsize=1 << 14)
def operator_key_rest(op: OperatorId, level: Level) -> Any:
    """:func:`~moe_ft.store.codec.key_rest` of the key of ``op``'s entry at ``level`` (what its header
    template is found by; the same at every iteration)."""
    return key_rest(entry_key(0, op, level))


def seal_from_sums(region: memoryview, layout: EntryLayout, iteration: int, op: OperatorId, level: Level, algo: str,
                   tensor_sums: list[list[int]]) -> WrittenEntry:
    """Seal the entry (``iteration``, ``op``, ``level``) whose tensors' bytes are in place in ``region`` from
    their ``mfh64`` lane sums (``codec.seal_entry``): the header from the layout's template when it has one (no
    key built), else encoded and summed. The trainer's store and the node agent (``handoff``) both seal so."""
    head, head_sums = (templated_head(layout, iteration, operator_key_rest(op, level), algo)
                       or sealed_head(layout, entry_key(iteration, op, level), algo))
    return seal_entry(region, layout, head, algo, tensor_sums, head_sums)


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class EntryRecord:
    """One entry of a point. ``op``/``level`` are ``None`` for the per-iteration metadata entry."""

    iteration: int
    op: OperatorId | None
    level: Level | None
    blob: str
    nbytes: int  # file size, header and trailer included
    checksum: str  # hex digest, algorithm in PointRecord.checksum_algo
    tensors: tuple[TensorRecord, ...]
    remote: bool = False
    """Held by the replica peers only (MoEtion §5.2 with ``--ft-optimizer-recompute-local compute``): the
    owner hashed this FULL entry without writing it, wrote the operator's COMPUTE entry instead, and its
    peers rebuild the FULL entry from the step's gradients; the file is present here only once fetched
    (:meth:`SnapshotStore.add_blob`). Serialised in the manifest's ``remote`` list."""

    @property
    def key(self) -> dict[str, Any]:
        return entry_key(self.iteration, self.op, self.level)

    @property
    def name(self) -> str:
        if self.op is None:
            return "meta"
        assert self.level is not None, "an operator's entry has a level"
        return f"{self.op}@{self.level.name}"

    def to_json(self) -> dict[str, Any]:
        out = {"blob": self.blob, "nbytes": self.nbytes, "checksum": self.checksum,
               "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
                           for t in self.tensors]}
        if self.op is not None:
            assert self.level is not None, "an operator's entry has a level"
            out.update(operator=str(self.op), level=self.level.name)
        return out

    @staticmethod
    def from_json(iteration: int, data: dict[str, Any]) -> "EntryRecord":
        op = OperatorId.parse(data["operator"]) if "operator" in data else None
        level = Level[data["level"]] if "level" in data else None
        tensors = tuple(TensorRecord(t["name"], t["dtype"], tuple(t["shape"]), int(t["nbytes"]))
                        for t in data["tensors"])
        return EntryRecord(iteration, op, level, data["blob"], int(data["nbytes"]), data["checksum"], tensors)


@dataclass(frozen=True)
class PointRecord:
    """A published point as its manifest describes it."""

    iteration: int
    checksum_algo: str
    entries: dict[OperatorId, EntryRecord]
    meta: EntryRecord | None
    created_unix: float = 0.0
    writer: dict[str, Any] = field(default_factory=dict)
    shadowed: dict[OperatorId, EntryRecord] = field(default_factory=dict)
    """The local COMPUTE entries of the operators whose FULL entry is remote (in :attr:`entries`, which
    holds the newest state of every operator the point has: the remote FULL one wins). Nothing restores
    from them; they are the owner's own copy of the compute weights."""

    def level(self, op: OperatorId) -> Level:
        entry = self.entries.get(op)
        if entry is None:
            return Level.NONE
        assert entry.level is not None, "an operator's entry has a level"
        return entry.level

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + (self.meta.nbytes if self.meta else 0)

    def all_entries(self) -> list[EntryRecord]:
        return sorted(self.entries.values(), key=_entry_order) + ([self.meta] if self.meta else [])


def _entry_order(entry: EntryRecord) -> tuple[str, int, int]:
    """Entries in :class:`OperatorId` order (by its fields, without the dataclass's Python ``__lt__``)."""
    assert entry.op is not None, "only operators' entries are sorted"
    return entry.op.kind, entry.op.layer, entry.op.expert


def _digest(body: dict[str, Any], algo: str) -> str:
    h = new_checksum(algo)
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return h.digest().hex()


def _join_checksum(before: str, after: str, algo: str) -> str:
    """The canonical JSON of a manifest from the canonical text of its keys' pairs that sort before
    ``manifest_checksum`` (``before``) and after it (``after``): the checksum (what :func:`_digest` gives) is
    of ``{before,after}`` -- a dict's canonical JSON is its keys' pairs in sorted order -- and the manifest
    is ``{before,"manifest_checksum":"…",after}``, each part encoded once."""
    h = new_checksum(algo)
    h.update(("{" + ",".join(p for p in (before, after) if p) + "}").encode())
    return "{" + ",".join(p for p in (before, f'"manifest_checksum":"{h.digest().hex()}"', after) if p) + "}"


_canonical = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=1 << 14)
def _tensors_json(tensors: tuple[TensorRecord, ...]) -> str:
    """An entry's tensor table as the manifest spells it (the same at every point of the entry's layout)."""
    return _canonical([{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
                       for t in tensors])


@functools.lru_cache(maxsize=1 << 14)
def _entry_names_json(blob: str, op: OperatorId | None, level: Level | None) -> tuple[str, str, str]:
    """The canonical text of an entry's name fields: its blob's pair, its level's and its operator's."""
    if op is None:
        return _canonical(blob), "", ""
    assert level is not None, "an operator's entry has a level"
    return _canonical(blob), f'"level":{_canonical(level.name)},', f',"operator":{_canonical(str(op))}'


def _plain(value: Any) -> str:
    """``_canonical(value)`` for the fields that change at every point: an ``int`` and an ASCII
    alphanumeric string (a hex digest) are written directly, anything else through the encoder."""
    if type(value) is int:
        return str(value)
    if type(value) is str and value.isascii() and value.isalnum():
        return f'"{value}"'
    return _canonical(value)


def _entry_json(e: EntryRecord) -> str:
    """``_canonical(e.to_json())``, from the parts an entry's layout fixes (remembered) and its checksum and
    size: the manifest is encoded at every publish, on the snapshot thread of the trainer."""
    blob, level, op = _entry_names_json(e.blob, e.op, e.level)
    return (f'{{"blob":{blob},"checksum":{_plain(e.checksum)},{level}"nbytes":{_plain(e.nbytes)}{op},'
            f'"tensors":{_tensors_json(e.tensors)}}}')


def entry_json_bound(e: EntryRecord, algo: str) -> int:
    """Bytes of ``e``'s JSON in a manifest whatever its digest: with the widest one ``algo`` gives (a record made
    before its entry is sealed carries none yet; a deferred one, :data:`~moe_ft.store.codec.PENDING`, is empty)."""
    return len(_entry_json(replace(e, checksum="0" * 2 * new_checksum(algo).digest_size)))


def manifest_bound(iteration: int, algo: str, entries: Sequence[int], meta: int | None, remote: Sequence[int]) -> int:
    """Bytes at most of the manifest :func:`build_manifest` writes for entries, a metadata entry and remote
    entries whose JSON takes at most these (:func:`entry_json_bound`): what is reserved for it before it
    exists, when another process writes it (``handoff.manifest_room``). The fields around the entries are
    measured on an empty manifest of this process; ``created_unix``'s text varies by a few characters."""
    empty = len(build_manifest(iteration, algo, [], None)[0])
    listed = sum(n + 1 for n in entries)  # each entry and its comma
    held = len('"remote":[],') + sum(n + 1 for n in remote) if remote else 0
    return empty + 32 + listed + (meta or 0) + held


def encode_manifest(iteration: int, algo: str, entries: list[EntryRecord], meta: EntryRecord | None) -> bytes:
    return build_manifest(iteration, algo, entries, meta)[0]


def _overlay(entries: list[EntryRecord], remote: list[EntryRecord]) -> tuple[dict, dict]:
    """``(entries by operator with the remote FULL ones winning, the local entries they shadow)``."""
    by_op = {e.op: e for e in entries}
    shadowed = {e.op: by_op[e.op] for e in remote if e.op in by_op}
    by_op.update({e.op: e for e in remote})
    return by_op, shadowed


def table_records(table) -> tuple[TensorRecord, ...]:
    """The tensor records of an entry's tensor table (its layout's, or what writing it returned)."""
    return tuple(TensorRecord(t["name"], t["dtype"], tuple(t["shape"]), t["nbytes"]) for t in table)


def entry_record(iteration: int, op: OperatorId | None, level: Level | None, blob: str, written) -> EntryRecord:
    """The record of an entry as written (``codec.WrittenEntry``: its size, digest and tensor table)."""
    return EntryRecord(iteration, op, level, blob, written.nbytes, written.checksum, table_records(written.tensors))


def build_manifest(iteration: int, algo: str, entries: list[EntryRecord], meta: EntryRecord | None,
                   remote: Sequence[EntryRecord] = (), *, writer_pid: int | None = None) -> tuple[bytes, PointRecord]:
    """The manifest bytes of a point and the :class:`PointRecord` that decoding them gives (without the
    round trip). Compact JSON (one line; ``python -m json.tool`` pretty-prints it): an indented dump takes
    the pure-Python encoder, several times slower than the C one, on every publish. ``remote``: FULL
    entries held by the replica peers only (:attr:`EntryRecord.remote`); the key is written only when
    there are some, so every other manifest is what it always was. ``writer_pid``: the process that wrote the
    entries, when another one publishes them (the node agent); this one by default."""
    remote = [e if e.remote else replace(e, remote=True) for e in remote]
    if any(e.op is None or e.level != Level.FULL for e in remote):
        raise ValueError("only operator FULL entries can be held by replica peers alone")
    created, writer = time.time(), {"pid": writer_pid or os.getpid(), "host": _HOST}
    # the canonical JSON of {"checksum_algo", "created_unix", "entries", "format", "iteration", "meta",
    # ["remote"], "writer"} (keys in sorted order, as json.dumps(sort_keys=True) writes them), entry by entry
    def listed(records: Sequence[EntryRecord]) -> str:
        return "[" + ",".join(_entry_json(e) for e in sorted(records, key=_entry_order)) + "]"

    before = (f'"checksum_algo":{_canonical(algo)},"created_unix":{_canonical(created)},"entries":{listed(entries)},'
              f'"format":{_canonical(FORMAT)},"iteration":{_canonical(iteration)}')
    after = (f'"meta":{_entry_json(meta) if meta else "null"},' + (f'"remote":{listed(remote)},' if remote else "")
             + f'"writer":{_canonical(writer)}')
    data = _join_checksum(before, after, algo).encode()
    by_op, shadowed = _overlay(entries, remote)
    return data, PointRecord(iteration, algo, by_op, meta, created, dict(writer), shadowed)


_HOST = socket.gethostname()


def decode_manifest(data: bytes, iteration: int, where: str) -> PointRecord:
    try:
        body = json.loads(data)
        stored = body.pop("manifest_checksum")
        algo = body["checksum_algo"]
        if body.get("format") != FORMAT:
            raise CorruptEntryError(where, f"unsupported manifest format {body.get('format')!r}, "
                                           f"this moe-ft reads {FORMAT!r}")
        if _digest(body, algo) != stored:
            raise CorruptEntryError(where, "manifest checksum mismatch")
        if body["iteration"] != iteration:
            raise CorruptEntryError(where, f"manifest is for iteration {body['iteration']}")
        entries = [EntryRecord.from_json(iteration, e) for e in body["entries"]]
        remote = [replace(EntryRecord.from_json(iteration, e), remote=True) for e in body.get("remote", ())]
        if any(e.op is None or e.level != Level.FULL for e in remote):
            raise CorruptEntryError(where, "a remote entry that is not an operator's FULL entry")
        meta = EntryRecord.from_json(iteration, body["meta"]) if body["meta"] else None
        by_op, shadowed = _overlay(entries, remote)
        return PointRecord(iteration, algo, by_op, meta, float(body["created_unix"]), dict(body["writer"]),
                           shadowed)
    except CorruptEntryError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptEntryError(where, f"unreadable manifest ({type(exc).__name__}: {exc})") from None
