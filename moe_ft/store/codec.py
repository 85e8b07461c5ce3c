"""Byte format of one store entry: a set of named CPU tensors stored with exact dtype, shape and raw bytes.

File layout (little-endian), see ``docs/store.md``::
    0    8  magic  b"MOEFTENT"
    8    4  format version (uint32) = 1
    12   4  header length H (uint32)
    16   H  header: UTF-8 JSON {"key": {...}, "checksum": algo, "tensors": [{"name", "dtype", "shape",
            "offset", "nbytes"}], "meta": {...} (metadata entries only)}
    ...     zero padding; every tensor's bytes start at a 64-byte aligned file offset
    ...     tensor bytes, in header order
    end-D-16  D bytes: digest of everything before it (the *body*)
    end-16    8 bytes: body length (uint64), then 8 bytes magic b"MOEFTEND"

The digest covers the header (so dtype, shape, names and the key) and all tensor bytes. Tensors are written
from ``tensor.view(torch.uint8)`` memory views, never pickled, and the checksum is computed chunk by chunk
just before each chunk is written, while it is still in cache.

Low precision: every ``torch.float8_*`` dtype is stored as its raw bytes under its own dtype name
and read back as the same dtype — no value passes through a wider dtype. A quantized tensor *subclass*
(Transformer Engine's ``Float8Tensor``, whose nominal dtype is bf16) is refused: its state is its FP8 data and
scales, which ``moe_ft.precision.quantized`` decomposes into plain tensors.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Mapping

import torch
import xxhash

from moe_ft.store import entry_hash
from moe_ft.store.errors import CorruptEntryError

MAGIC = b"MOEFTENT"
END_MAGIC = b"MOEFTEND"
VERSION = 1
ALIGN = 64
# checksum+write granularity: large enough to amortise calls, small enough that the write after the hash
# reads the piece from the core's L2 cache, not from memory again. Measured on the 2-core test machine
# (L2 2 MiB per core; write_entry of 8 x 16 MiB into a mapping, xxh3_64): 8 MiB pieces 4.26 GB/s, 2 MiB 4.76,
# 1 MiB 5.10, 512 KiB 5.01, 256 KiB 4.82; writing alone (digest deferred) 6.37 GB/s. At 1 MiB the hash adds
# 25 % to the write instead of 50 %.
CHUNK = 1 << 20
COALESCE = 256 << 10  # pieces below this are gathered (one memcpy) and written together
_PREFIX = struct.Struct("<8sII")
_TAIL = struct.Struct("<Q8s")

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "uint16", "uint32", "uint64", "complex64", "complex128",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_DTYPE_TO_NAME = {d: n for n, d in DTYPES.items()}
_QUANTIZED_ATTRS = ("_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv")  # TE quantized tensor storage


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored; supported: {sorted(DTYPES)}") from None


class _Crc32:
    digest_size = 4

    def __init__(self) -> None:
        self._value = 0

    def update(self, buf: Any) -> None:
        self._value = zlib.crc32(buf, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "little")


CHECKSUMS: dict[str, Callable[[], Any]] = {
    # XXH3-64 (the maintained ``xxhash`` package): ~35 GB/s in cache and memory-bound (~11 GB/s) on
    # state-sized buffers here, 2x hardware CRC32C and 5x zlib's crc32, with a 64-bit digest; it takes
    # any buffer (memoryviews of pinned tensors) without a copy. The threat model is torn writes and bit
    # flips, not an adversary. docs/store.md, "Checksum choice", has the measurements.
    "xxh3_64": xxhash.xxh3_64,
    # zlib's crc32 was the default before: kept so that stores, replicas and durable points written with
    # it stay readable (every manifest and entry header names its algorithm).
    "crc32": _Crc32,
    "blake2b": lambda: hashlib.blake2b(digest_size=16),
    # position-keyed and order-free (moe_ft/store/entry_hash.py): the payload can be hashed on the device
    # that holds it, in parallel blocks, and the host adds the header's share; ~1.7 GB/s per core to verify
    "mfh64": entry_hash.Mfh64,
}
DEFAULT_CHECKSUM = "xxh3_64"
PENDING = ""
"""The checksum of an entry written with its digest deferred (``write_entry(defer=True)``): the trailer holds
zeros in the digest's place and the manifest this; the node agent hashes the published entry and records its
digest beside the point (``SnapshotStore.record_verified``). Until then the entry is *unverified*: readers
check its structure only."""


def new_checksum(algo: str) -> Any:
    try:
        return CHECKSUMS[algo]()
    except KeyError:
        raise ValueError(f"unknown checksum {algo!r}; choose one of {sorted(CHECKSUMS)}") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, any rank, including 0-dim and empty)."""
    # ndarray has the buffer protocol; numpy's stubs declare it (``__buffer__``) only for Python >= 3.12
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def check_tensor(name: str, tensor: Any) -> torch.Tensor:
    """``tensor`` if the store can write it as it is (a named, contiguous, unquantized CPU tensor of a stored
    dtype); else a ``ValueError`` that names the problem and the fix."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"entry value {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
    if any(hasattr(tensor, a) for a in _QUANTIZED_ATTRS):  # duck-typed: Transformer Engine is never imported
        raise ValueError(f"tensor {name!r} is a quantized {type(tensor).__name__}: writing it would dequantize it; "
                         "store its components (moe_ft.precision.quantized.quantized_weight)")
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor {name!r} is on {tensor.device}; copy it to (pinned) host memory first")
    dtype_name(tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"tensor {name!r} is not contiguous; the store writes raw bytes without copying")
    return tensor


@dataclass(frozen=True)
class WrittenEntry:
    """What writing an entry produced: the file size, its digest (hex) and the tensor table."""

    nbytes: int
    checksum: str
    tensors: tuple[dict, ...]
    hashed: int = 0
    """Bytes the checksum read (everything before the digest: the writer's host pass over the payload)."""


@dataclass(frozen=True)
class EntryLayout:
    """Where an entry's parts go (the file layout in the module docstring), from its tensors' names, dtypes
    and shapes: the header is padded to ``reserve`` bytes, tensor ``i`` starts at ``table[i]["offset"]``, the
    digest at ``body``, and the entry is ``size`` bytes. A layout stays valid for another key of the same
    tensors as long as that key's header fits the reserve (:func:`entry_head`)."""

    reserve: int
    table: tuple[dict, ...]
    body: int
    size: int

    @functools.cached_property
    def table_json(self) -> str:
        """The tensor table as the header spells it (canonical JSON): the same for every key of the layout."""
        return _dumps(list(self.table))

    @functools.cached_property
    def heads(self) -> dict:
        """Header templates of this layout for :func:`sealed_head`, by key without its iteration and the
        iteration's number of digits."""
        return {}

    @functools.cached_property
    def padding(self) -> tuple[list[int], int]:
        """The ``mfh64`` lane sums of the entry's zero padding -- from the end of the header (its last word
        zero-padded) to the first tensor, and between tensors (from the word after a tensor's last one) --
        and the bytes a host hashes to seal the entry (header and padding). Both are the same at every key,
        so :func:`entry_digest` hashes the padding once per layout, not once per entry."""
        head_words = -(-(_PREFIX.size + self.reserve) // 4)
        first = self.table[0]["offset"] // 4 if self.table else self.body // 4
        runs = [(head_words, first - head_words)]
        for i, rec in enumerate(self.table):
            end_word = -(-(rec["offset"] + rec["nbytes"]) // 4)
            nxt = self.table[i + 1]["offset"] // 4 if i + 1 < len(self.table) else end_word
            runs.append((end_word, nxt - end_word))
        sums = [0, 0]
        for start, count in runs:
            sums = [(a + b) & entry_hash.MASK for a, b in zip(sums, entry_hash.zero_word_sums(start, count))]
        return sums, 4 * sum(count for _, count in runs[1:]) + (self.table[0]["offset"] if self.table else self.body)

    @functools.cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of the zero padding an entry holds: from the end of the head to the first tensor
        (the digest when there is none), and between tensors (what :func:`seal_entry` writes around them)."""
        head = _PREFIX.size + self.reserve
        first = self.table[0]["offset"] if self.table else self.body
        runs = [(head, first)]
        for rec, nxt in zip(self.table, self.table[1:]):
            runs.append((rec["offset"] + rec["nbytes"], nxt["offset"]))
        return tuple((a, b) for a, b in runs if b > a)

    @functools.cached_property
    def first_words(self) -> list[int]:
        """Each tensor's first word index in the entry (what its device digest is keyed by)."""
        return [rec["offset"] // 4 for rec in self.table]

    @functools.cached_property
    def splits(self) -> list[int]:
        """Sizes that cut ``[0, body)`` into head, tensor, gap, tensor, ... (``torch.split``: the tensors'
        byte views are the odd pieces)."""
        sizes, pos = [], 0
        for rec in self.table:
            sizes += [rec["offset"] - pos, rec["nbytes"]]
            pos = rec["offset"] + rec["nbytes"]
        return sizes


def _head_json(key: Mapping[str, Any], algo: str, meta_json: str | None) -> str:
    # The header is the canonical JSON (sorted keys, no spaces) of {"checksum", "key", "meta", "tensors"};
    # it is assembled from parts so that the metadata (hundreds of numbers: RNG states) is encoded once.
    return (f'{{"checksum":{_dumps(algo)},"key":{_dumps(dict(key))},'
            + (f'"meta":{meta_json},' if meta_json is not None else "") + '"tensors":')


WIDE_ITERATION = 10 ** 12 - 1
"""Headers are laid out as if the iteration had at least this many digits (12): an entry's tensors sit at
the same offsets at every iteration below 10^12, so a layout, and what is keyed by its offsets (the
device digests of ``moe_ft/snapshot/mapped.py``), is computed once per entry shape, not again at 10, 100,
1000 ... (the header is padded with spaces, which JSON ignores)."""


def layout_entry(key: Mapping[str, Any], specs, algo: str,
                 meta_json: str | None = None, *, slack: int = 0) -> EntryLayout:
    """The layout of an entry of ``specs`` (``(name, dtype name, shape, nbytes)`` in order); ``slack``
    extra header bytes beyond :data:`WIDE_ITERATION`'s."""
    if isinstance(key.get("iteration"), int) and key["iteration"] < WIDE_ITERATION:
        key = dict(key, iteration=WIDE_ITERATION)
    head = _head_json(key, algo, meta_json)
    table: list[dict] = []
    # Offsets depend on the header length and the header contains the offsets: lay out with a guess of
    # the header length, then grow the guess until it is stable (two rounds in practice).
    reserve = 0
    while True:
        table.clear()
        offset = _align(_PREFIX.size + reserve)
        for name, dtype, shape, nbytes in specs:
            table.append({"dtype": dtype, "name": name, "nbytes": nbytes, "offset": offset, "shape": list(shape)})
            offset = _align(offset + nbytes)
        header_len = len((head + _dumps(table) + "}").encode())
        if header_len + slack <= reserve:
            break
        reserve = header_len + slack + 64
    body = table[-1]["offset"] + table[-1]["nbytes"] if table else _PREFIX.size + reserve
    return EntryLayout(reserve, tuple(table), body, body + new_checksum(algo).digest_size + _TAIL.size)


def entry_head(layout: EntryLayout, key: Mapping[str, Any], algo: str, meta_json: str | None = None) -> bytes:
    """The entry's prefix and header (padded to the layout's reserve) for ``key``; ``ValueError`` when the
    header does not fit the layout (lay it out again)."""
    header = (_head_json(key, algo, meta_json) + layout.table_json + "}").encode()
    if len(header) > layout.reserve:
        raise ValueError(f"entry header of {len(header)} bytes does not fit the layout's {layout.reserve}")
    return _PREFIX.pack(MAGIC, VERSION, layout.reserve) + header.ljust(layout.reserve, b" ")  # JSON allows spaces


def sealed_head(layout: EntryLayout, key: Mapping[str, Any], algo: str) -> tuple[bytes, list[int] | None]:
    """:func:`entry_head` and, for ``mfh64``, its lane sums (the last word zero-padded; ``None`` for another
    checksum). An entry is sealed at every point with the same header but for the iteration's digits, so the
    header is built and hashed once per layout, key and number of digits (:attr:`EntryLayout.heads`), and
    then only the words holding the digits are hashed again."""
    it = key.get("iteration")
    if algo != entry_hash.ALGO:
        return entry_head(layout, key, algo), None
    if not isinstance(it, int) or isinstance(it, bool) or it < 0:
        head = entry_head(layout, key, algo)
        return head, entry_hash.bytes_lane_sums(head)
    digits = str(it).encode()
    slot = (key_rest(key), len(digits))
    template = layout.heads.get(slot)
    if template is None:
        placeholder = b"1" * len(digits)
        head = entry_head(layout, dict(key, iteration=int(placeholder)), algo)
        # the key's JSON (sorted) starts with its iteration when no other key sorts before it
        pos = _PREFIX.size + len(f'{{"checksum":{_dumps(algo)},"key":{{"iteration":'.encode())
        end = pos + len(digits)
        if head[pos:end] != placeholder or head[end:end + 1] not in (b",", b"}"):  # another key sorts first
            head = entry_head(layout, key, algo)
            return head, entry_hash.bytes_lane_sums(head)
        first, last = pos // 4, -(-end // 4)  # the words that hold the digits
        sums = entry_hash.bytes_lane_sums(head)
        terms = entry_hash.words_terms(_words(head, first, last), first)
        # the header's sums without the digits' words: each point adds its digits' words' terms
        template = layout.heads[slot] = (head, pos, first, last, [a - b for a, b in zip(sums, terms)])
    return _from_template(template, digits)


def _from_template(template: tuple, digits: bytes) -> tuple[bytes, list[int]]:
    """A header and its lane sums from a template of :attr:`EntryLayout.heads` and the iteration's digits."""
    base, pos, first, last, rest = template
    head = base[:pos] + digits + base[pos + len(digits):]
    t0, t1 = entry_hash.words_terms(_words(head, first, last), first)
    return head, [(rest[0] + t0) & entry_hash.MASK, (rest[1] + t1) & entry_hash.MASK]


def templated_head(layout: EntryLayout, iteration: int, rest: Any, algo: str) -> tuple[bytes, list[int]] | None:
    """What :func:`sealed_head` returns for a key whose :func:`key_rest` is ``rest`` at ``iteration``, when the
    layout already has its template (``None``: call :func:`sealed_head`, which makes it). Each entry of every
    point is sealed on the snapshot thread: a caller that remembers ``rest`` builds no key."""
    if algo != entry_hash.ALGO or type(iteration) is not int or iteration < 0:
        return None
    digits = str(iteration).encode()
    template = layout.heads.get((rest, len(digits)))
    return None if template is None else _from_template(template, digits)


def _words(data: bytes, first: int, last: int) -> bytes:
    """Words ``[first, last)`` of ``data`` (the last one zero-padded)."""
    return data[4 * first:4 * last].ljust(4 * (last - first), b"\0")


def key_rest(key: Mapping[str, Any]) -> Any:
    """The key without its iteration, as a cache key of :attr:`EntryLayout.heads`: its items in order with
    their types (``1``, ``1.0`` and ``True`` are equal in Python, not in JSON; the same items in another
    order only build another template), or the canonical JSON of a key whose values cannot be hashed."""
    rest = tuple((k, type(v), v) for k, v in key.items() if k != "iteration")
    try:
        hash(rest)
    except TypeError:
        return _dumps({k: v for k, v in key.items() if k != "iteration"})
    return rest


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...], int], ...]:
    """``(name, dtype name, shape, nbytes)`` of each tensor, in order (what :func:`layout_entry` takes;
    hashable, so that layouts can be cached by it)."""
    return tuple((name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                 for name, t in tensors.items())


def write_entry(
    write: Callable[[Any], Any], key: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
    algo: str, meta: Mapping[str, Any] | None = None, *, meta_json: str | None = None,
    expect: Callable[[int], Any] | None = None, defer: bool = False,
) -> WrittenEntry:
    """Stream one entry through ``write`` (called with byte buffers, in order) and return its record.
    ``meta_json``: ``meta`` already encoded with :func:`encode_meta` (instead of ``meta``). ``expect``: called
    once with the entry's exact size in bytes before the first ``write`` (a sink can take a recycled file of
    that size, :class:`moe_ft.store.local.LocalFSBackend`). ``defer``: do not hash (the writer passes over
    each byte once): the digest's place in the trailer holds zeros and the checksum is :data:`PENDING`."""
    checked = [(name, check_tensor(name, t)) for name, t in tensors.items()]
    if meta is not None:
        meta_json = encode_meta(meta)
    layout = layout_entry(key, tensor_specs(dict(checked)), algo, meta_json)
    head = entry_head(layout, key, algo, meta_json)
    digest = new_checksum(algo)
    if expect is not None:
        expect(layout.size)
    pos = 0
    # Small pieces (prefix, header, padding, small tensors) are gathered into one buffer and checksummed
    # and written together: one write call per ~COALESCE bytes instead of two per tensor.
    pending = bytearray()
    small = min(COALESCE, CHUNK)

    def flush() -> None:
        if pending:
            if not defer:
                digest.update(pending)
            write(pending)
            pending.clear()

    def emit(buf: Any) -> None:
        nonlocal pos
        n = len(buf)
        if n < small:
            pending.extend(buf)
            if len(pending) >= small:
                flush()
        else:
            flush()
            if not defer:
                digest.update(buf)
            write(buf)
        pos += n

    emit(head)
    for (name, t), rec in zip(checked, layout.table):
        emit(bytes(rec["offset"] - pos))
        data = raw_bytes(t)
        for start in range(0, len(data), CHUNK):
            emit(data[start:start + CHUNK])
    flush()
    final = bytes(digest.digest_size) if defer else digest.digest()
    write(final + _TAIL.pack(pos, END_MAGIC))
    assert pos == layout.body, (pos, layout.body)  # the layout above is what was written
    return WrittenEntry(layout.size, PENDING if defer else final.hex(), tuple(dict(r) for r in layout.table),
                        hashed=0 if defer else pos)


def entry_digest(layout: EntryLayout, head: bytes, tensor_sums: list[list[int]],
                 head_sums: list[int] | None = None) -> tuple[bytes, int]:
    """The ``mfh64`` digest of an entry whose tensors were hashed where they live (device lane sums of each
    tensor, indexed from its offset: :class:`moe_ft.store.entry_hash_triton.TensorTable`): the host hashes
    the prefix and the header (the zero padding's share is the layout's, :attr:`EntryLayout.padding`;
    ``head_sums``: the header's share when known, :func:`sealed_head`). Returns the digest and the bytes
    hashed on the host (header and padding)."""
    if len(tensor_sums) != len(layout.table):
        raise ValueError(f"{len(tensor_sums)} tensor digests for an entry of {len(layout.table)} tensors")
    _check_head(layout, head)
    # the head's last word zero-padded: the padding's first bytes complete it (the padding's share starts at
    # the next whole word, EntryLayout.padding)
    sums = entry_hash.bytes_lane_sums(head) if head_sums is None else head_sums
    pad, host_bytes = layout.padding
    parts = (pad, *tensor_sums)  # sums mod 2^32: added as Python integers, reduced once (pack masks them)
    return entry_hash.pack(layout.body, [int(sums[0]) + sum(int(p[0]) for p in parts),
                                         int(sums[1]) + sum(int(p[1]) for p in parts)]), host_bytes


def _check_head(layout: EntryLayout, head: bytes) -> None:
    if len(head) != _PREFIX.size + layout.reserve:
        raise ValueError(f"an entry head of {len(head)} bytes for a layout whose head is "
                         f"{_PREFIX.size + layout.reserve} (entry_head pads it to the reserve)")


def seal_entry(region: memoryview, layout: EntryLayout, head: bytes, algo: str,
               tensor_sums: list[list[int]] | None = None, head_sums: list[int] | None = None) -> WrittenEntry:
    """Finish an entry whose tensor bytes are already in place in ``region`` (its ``layout.size`` bytes,
    e.g. a mapped store region that a device-to-host copy filled): write the head, the zero padding, the
    digest and the trailer around them. ``tensor_sums``: the tensors' ``mfh64`` lane sums computed where the
    bytes came from (``algo`` must be ``mfh64``; the host then reads no payload byte); ``None``: hash the
    region on the host."""
    if len(region) != layout.size:
        raise ValueError(f"region of {len(region)} bytes for an entry of {layout.size}")
    _check_head(layout, head)
    region[:len(head)] = head
    for a, b in layout.gaps:
        region[a:b] = _ZEROS[:b - a] if b - a <= len(_ZEROS) else bytes(b - a)
    if tensor_sums is None:
        digest = new_checksum(algo)
        digest.update(region[:layout.body])
        final, hashed = digest.digest(), layout.body
    elif algo != entry_hash.ALGO:
        raise ValueError(f"tensor digests computed on the device are {entry_hash.ALGO}, the store uses {algo}")
    else:
        final, hashed = entry_digest(layout, head, tensor_sums, head_sums)
    region[layout.body:] = final + _TAIL.pack(layout.body, END_MAGIC)
    return WrittenEntry(layout.size, final.hex(), tuple(dict(r) for r in layout.table), hashed=hashed)


_ZEROS = memoryview(bytes(4 * ALIGN))
"""Zero bytes for an entry's padding (:func:`layout_entry` aligns every tensor to ``ALIGN``, so its gaps are
shorter; a longer gap is allocated)."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def encode_meta(meta: Mapping[str, Any]) -> str:
    """The JSON text stored as an entry's ``meta`` (raises ``TypeError``/``ValueError`` if not JSON-able)."""
    return _dumps(dict(meta))


def _read_exact(stream: BinaryIO, buf: memoryview, where: str) -> None:
    got = 0
    while got < len(buf):
        n = stream.readinto(buf[got:])  # type: ignore[attr-defined]  # files and BytesIO have it; BinaryIO's stub not
        if not n:
            raise CorruptEntryError(where, f"truncated: file ended after {got} of {len(buf)} expected bytes")
        got += n


@dataclass
class DecodedEntry:
    header: dict
    tensors: dict[str, torch.Tensor]
    digest: str = ""
    """The digest computed from the bytes read (hex): what the node agent records for a :data:`PENDING` entry."""


def read_entry(
    stream: BinaryIO, *, size: int, checksum: str, algo: str, key: Mapping[str, Any], where: str,
    out: Mapping[str, torch.Tensor] | None = None,
) -> DecodedEntry:
    """Read and verify an entry of ``size`` bytes whose digest must equal ``checksum`` (hex; :data:`PENDING`:
    an entry whose digest is not recorded yet, checked for its structure only, its digest computed).

    Without ``out`` the file is read into one fresh buffer that the returned tensors share. With ``out``
    (name → pre-allocated contiguous CPU tensor of the stored dtype and shape, e.g. pinned buffers) the
    bytes are read straight into those tensors; if verification then fails their contents are undefined
    and :class:`CorruptEntryError` is raised. Nothing unverified is ever returned.
    """
    digest = new_checksum(algo)
    tail = digest.digest_size + _TAIL.size
    if size < _PREFIX.size + tail:
        raise CorruptEntryError(where, f"file is {size} bytes, too small to be an entry")
    prefix = bytearray(_PREFIX.size)
    _read_exact(stream, memoryview(prefix), where)
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError(where, f"bad magic/version {magic!r}/{version}")
    if _PREFIX.size + header_len + tail > size:
        raise CorruptEntryError(where, f"header length {header_len} exceeds file size {size}")
    digest.update(prefix)
    if out is None:
        # Whole file into one buffer; verify before interpreting a single byte of the header.
        body = bytearray(size - _PREFIX.size)
        _read_exact(stream, memoryview(body), where)
        split = size - tail - _PREFIX.size
        digest.update(memoryview(body)[:split])
        final = digest.digest()
        _check_trailer(final, bytes(body[split:]), size - tail, checksum, algo, where)
        header = _parse_header(bytes(body[:header_len]), key, where, _PREFIX.size + header_len, size - tail)
        return DecodedEntry(header, _views(body, header["tensors"]), final.hex())
    header_bytes = bytearray(header_len)
    _read_exact(stream, memoryview(header_bytes), where)
    digest.update(header_bytes)
    pos = _PREFIX.size + header_len
    try:
        table = _out_table(header_bytes, out, pos, size - tail)
    except _Unusable as exc:
        # The header is not verified yet: a flipped bit in it must surface as corruption, not as a
        # complaint about the caller's buffers. Checksum the rest, then blame the right party.
        _drain(stream, digest, size - tail - pos, where)
        trailer = bytearray(tail)
        _read_exact(stream, memoryview(trailer), where)
        _check_trailer(digest.digest(), bytes(trailer), size - tail, checksum, algo, where)
        if exc.caller:
            raise ValueError(f"{where}: {exc}") from None
        raise CorruptEntryError(where, f"unreadable header ({exc})") from None
    for rec in table:
        gap = bytearray(rec["offset"] - pos)
        _read_exact(stream, memoryview(gap), where)
        digest.update(gap)
        view = raw_bytes(out[rec["name"]])
        _read_exact(stream, view, where)
        digest.update(view)
        pos = rec["offset"] + rec["nbytes"]
    rest = bytearray(size - pos)
    _read_exact(stream, memoryview(rest), where)
    digest.update(memoryview(rest)[: len(rest) - tail])
    final = digest.digest()
    _check_trailer(final, bytes(rest[len(rest) - tail:]), size - tail, checksum, algo, where)
    header = _parse_header(bytes(header_bytes), key, where, _PREFIX.size + header_len, size - tail)
    return DecodedEntry(header, {rec["name"]: out[rec["name"]] for rec in table}, final.hex())


def digest_view(view: memoryview, *, checksum: str, algo: str, key: Mapping[str, Any], where: str) -> str:
    """The digest (hex) of the entry whose bytes are ``view`` (all of them: e.g. a mapped store region),
    after the checks :func:`read_entry` makes (magic, header length, trailer, key; ``checksum`` compared unless
    :data:`PENDING`), without copying a byte: what the node agent runs over a published entry."""
    size = len(view)
    digest = new_checksum(algo)
    tail = digest.digest_size + _TAIL.size
    if size < _PREFIX.size + tail:
        raise CorruptEntryError(where, f"entry is {size} bytes, too small to be an entry")
    magic, version, header_len = _PREFIX.unpack(view[:_PREFIX.size])
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError(where, f"bad magic/version {magic!r}/{version}")
    if _PREFIX.size + header_len + tail > size:
        raise CorruptEntryError(where, f"header length {header_len} exceeds file size {size}")
    body = size - tail
    for start in range(0, body, CHUNK):
        digest.update(view[start:min(start + CHUNK, body)])
    final = digest.digest()
    _check_trailer(final, bytes(view[body:]), body, checksum, algo, where)
    _parse_header(bytes(view[_PREFIX.size:_PREFIX.size + header_len]), key, where, _PREFIX.size + header_len, body)
    return final.hex()


class _Unusable(Exception):
    """The (unverified) header cannot be read into the caller's buffers; ``caller``: it is readable and
    names tensors the buffers do not match (the caller's mistake, if the checksum then holds)."""

    def __init__(self, reason: str, caller: bool) -> None:
        super().__init__(reason)
        self.caller = caller


def _out_table(header_bytes: bytearray, out: Mapping[str, torch.Tensor], start: int, end: int) -> list[dict]:
    """The tensor table of an unverified header, checked against ``out`` and the file bounds."""
    try:
        table = list(json.loads(header_bytes)["tensors"])
        _check_table(table, start, end)
    except (ValueError, KeyError, TypeError) as exc:
        raise _Unusable(str(exc), caller=False) from None
    for rec in table:
        dst = out.get(rec["name"])
        if dst is None:
            raise _Unusable(f"no output buffer for tensor {rec['name']!r}", caller=True)
        if dtype_name(dst.dtype) != rec["dtype"] or list(dst.shape) != rec["shape"]:
            raise _Unusable(f"output buffer {rec['name']!r} is {dst.dtype}{list(dst.shape)}, entry holds "
                            f"{rec['dtype']}{rec['shape']}", caller=True)
        check_tensor(rec["name"], dst)
    return table


def _check_table(table: list, start: int, end: int) -> None:
    """Raise ``ValueError`` (``KeyError``, ``TypeError`` for a record missing a field) unless every record of a
    header's tensor table can be read as it says: a known dtype, a shape of non-negative integers whose
    elements take its ``nbytes``, its bytes inside ``[start, end)`` of the entry (after the header, before the
    trailer), in order and aligned for its dtype. A header is parsed after the digest is checked, but an entry
    whose digest is not recorded yet (:data:`PENDING`: ``--ft-checksum-by agent``) is checked for its
    structure only, and its table must not steer a view outside the buffer."""
    pos = start
    for rec in table:
        name, dtype_text, shape, offset, nbytes = rec["name"], rec["dtype"], rec["shape"], rec["offset"], rec["nbytes"]
        dtype = DTYPES.get(dtype_text) if isinstance(dtype_text, str) else None
        if not isinstance(name, str) or dtype is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype_text!r}")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r}")
        if type(offset) is not int or type(nbytes) is not int or math.prod(shape) * dtype.itemsize != nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes!r} bytes for {dtype_text}{shape}")
        if offset < pos or offset + nbytes > end or (offset - _PREFIX.size) % dtype.itemsize:
            raise ValueError(f"tensor {name!r} at offset {offset!r} lies outside the file or is misaligned")
        pos = offset + nbytes


def _drain(stream: BinaryIO, digest: Any, nbytes: int, where: str) -> None:
    """Feed the next ``nbytes`` of ``stream`` to ``digest`` through a bounded scratch buffer."""
    scratch = memoryview(bytearray(min(max(nbytes, 0), CHUNK)))
    while nbytes > 0:
        piece = scratch[: min(nbytes, len(scratch))]
        _read_exact(stream, piece, where)
        digest.update(piece)
        nbytes -= len(piece)


def _check_trailer(final: bytes, trailer: bytes, body_len: int, checksum: str, algo: str, where: str) -> None:
    stored, (stored_len, end_magic) = trailer[: len(final)], _TAIL.unpack(trailer[len(final):])
    if end_magic != END_MAGIC or stored_len != body_len:
        raise CorruptEntryError(where, "bad trailer (torn or truncated write)")
    deferred = stored == bytes(len(final))  # written with the digest deferred: the recorded one counts
    if checksum == PENDING and (deferred or final == stored):
        return  # not hashed by anyone yet: the structure holds
    if (final != stored and not deferred) or final.hex() != checksum:
        raise CorruptEntryError(where, f"checksum mismatch ({algo}: computed {final.hex()}, "
                                       f"file {stored.hex()}, manifest {checksum})")


def _parse_header(header_bytes: bytes, key: Mapping[str, Any], where: str, start: int, end: int) -> dict:
    """The header, its tensor table checked against the entry's bounds ``[start, end)`` (:func:`_check_table`)."""
    try:
        header = json.loads(header_bytes)
        header["tensors"] = list(header["tensors"])
        _check_table(header["tensors"], start, end)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(where, f"unreadable header ({exc})") from None
    if header.get("key") != dict(key):
        raise CorruptEntryError(where, f"entry holds {header.get('key')}, expected {dict(key)}")
    return header


def _views(body: bytearray, table: list[dict]) -> dict[str, torch.Tensor]:
    result = {}
    for rec in table:  # checked by _parse_header
        dtype = DTYPES[rec["dtype"]]
        start = rec["offset"] - _PREFIX.size
        if rec["nbytes"] == 0:
            result[rec["name"]] = torch.empty(rec["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(body, dtype=torch.uint8, count=rec["nbytes"], offset=start)
        result[rec["name"]] = flat.view(dtype).reshape(rec["shape"])
    return result
