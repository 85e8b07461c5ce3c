"""The store's entry checksum (docs/store.md "Checksum choice"): XXH3-64 by default, crc32 and blake2b
still readable. Every single-bit corruption of an entry file is detected, on both read paths (fresh
buffer and caller-provided ``out=`` buffers), and stores written with the former crc32 default verify
and load under the new default."""

from __future__ import annotations

import io
import json

import pytest
import torch
from _ft_helpers import damage_blob, flip_middle_byte

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig
from moe_ft.store.codec import CHECKSUMS, CHUNK, DEFAULT_CHECKSUM, read_entry, write_entry
from moe_ft.store.errors import CorruptEntryError

KEY = {"iteration": 7, "operator": "expert.L1.E3", "level": "FULL"}
OP = OperatorId.expert_op(1, 3)


def _tensors(scale: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"weight": torch.randn(8 * scale, 5, generator=gen),
            "exp_avg.weight": torch.randn(8 * scale, 5, generator=gen).to(torch.bfloat16),
            "step": torch.tensor(3, dtype=torch.int64),
            "mask": torch.tensor([True, False, True])}


def _encode(tensors, algo: str) -> tuple[bytes, str]:
    buf = io.BytesIO()
    written = write_entry(buf.write, KEY, tensors, algo)
    return buf.getvalue(), written.checksum


def _read(data: bytes, checksum: str, algo: str, out=None):
    return read_entry(io.BytesIO(data), size=len(data), checksum=checksum, algo=algo, key=KEY, where="test",
                      out=out)


def test_default_is_xxh3():
    assert DEFAULT_CHECKSUM == "xxh3_64"
    assert StoreConfig().checksum == "xxh3_64"


@pytest.mark.parametrize("algo", sorted(CHECKSUMS))
def test_every_single_bit_flip_is_detected(algo):
    """Flip each bit of a small entry (prefix, header, padding, tensor bytes, digest, trailer) in turn:
    every copy fails verification with CorruptEntryError on both read paths; the intact file reads back
    bitwise."""
    tensors = _tensors()
    data, checksum = _encode(tensors, algo)
    got = _read(data, checksum, algo).tensors
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    undetected = []
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        for buffers in (None, out):
            try:
                _read(bytes(flipped), checksum, algo, out=buffers)
            except CorruptEntryError:
                continue
            undetected.append((bit, buffers is not None))
    assert not undetected, f"{algo}: {len(undetected)} single-bit flips not detected, e.g. {undetected[:5]}"


def test_bit_flips_in_a_multi_chunk_entry():
    """An entry larger than one checksum chunk (the digest is streamed chunk by chunk): flips near the
    chunk boundaries, at both ends and at seeded random positions are all detected."""
    n = (CHUNK + (1 << 20)) // 4  # > one chunk of fp32
    big = {"weight": torch.arange(n, dtype=torch.float32), "bias": torch.ones(7)}
    data, checksum = _encode(big, DEFAULT_CHECKSUM)
    gen = torch.Generator().manual_seed(0)
    positions = {0, 100, len(data) - 1, len(data) - 20}
    for boundary in (CHUNK - 64, CHUNK, CHUNK + 64):
        positions.update(range(boundary - 3, boundary + 3))
    positions.update(torch.randint(0, len(data), (24,), generator=gen).tolist())
    out = {k: torch.empty_like(v) for k, v in big.items()}
    for pos in sorted(positions):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        for buffers in (None, out):
            with pytest.raises(CorruptEntryError):
                _read(bytes(flipped), checksum, DEFAULT_CHECKSUM, out=buffers)
    assert torch.equal(_read(data, checksum, DEFAULT_CHECKSUM, out=out).tensors["weight"], big["weight"])


def test_wrong_out_buffer_on_an_intact_entry_is_the_callers_error():
    tensors = _tensors()
    data, checksum = _encode(tensors, DEFAULT_CHECKSUM)
    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    out["weight"] = torch.empty(3, 5)
    with pytest.raises(ValueError, match="output buffer 'weight'"):
        _read(data, checksum, DEFAULT_CHECKSUM, out=out)


def test_store_written_with_crc32_reads_under_the_new_default(tmp_path):
    """A store written by the former default (crc32: manifest ``checksum_algo`` and entry headers say so)
    is catalogued, verified, searched and loaded by a store object whose own default is XXH3."""
    old = StoreConfig(root=str(tmp_path), job_id="j", checksum="crc32").build()
    tensors = _tensors()
    with old.begin(3) as point:
        point.put(OP, Level.FULL, tensors)
        point.put_meta({"grad_norm": 1.5}, {"rng": torch.arange(4)})
        point.publish()
    manifest = json.loads(old.backend.read_blob(3, "MANIFEST.json"))
    assert manifest["checksum_algo"] == "crc32" and len(manifest["entries"][0]["checksum"]) == 8

    new = StoreConfig(root=str(tmp_path), job_id="j").build()
    assert new.checksum == "xxh3_64"
    catalog = new.verify()
    assert not catalog.problems and catalog.iterations == [3]
    got = new.load(3, OP, Level.FULL)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert new.load_meta(3).meta == {"grad_norm": 1.5}
    # the new store's own points use XXH3 (16 hex digits) beside the old crc32 point
    with new.begin(4) as point:
        point.put(OP, Level.FULL, tensors)
        point.publish()
    assert new.catalog().point(4).checksum_algo == "xxh3_64"
    assert len(new.catalog().point(4).entries[OP].checksum) == 16
    assert not new.verify().problems

    # a flipped bit in the old point's entry is still caught by its own algorithm
    damage_blob(old, 3, "expert.L1.E3.full.ent", flip_middle_byte)
    assert [p.what for p in new.verify().problems] == ["expert.L1.E3@FULL"]
    with pytest.raises(CorruptEntryError, match="crc32"):
        new.load(3, OP, Level.FULL)


def test_unknown_algorithm_in_a_manifest_is_a_clear_error(tmp_path):
    store = StoreConfig(root=str(tmp_path), job_id="j").build()
    with store.begin(1) as point:
        point.put_meta({"x": 1})
        point.publish()
    body = json.loads(store.backend.read_blob(1, "MANIFEST.json"))
    body["checksum_algo"] = "md4"
    damage_blob(store, 1, "MANIFEST.json", lambda data: json.dumps(body, separators=(",", ":")).encode().ljust(len(data)))
    problems = StoreConfig(root=str(tmp_path), job_id="j").build().catalog().problems
    assert len(problems) == 1 and "unknown checksum 'md4'" in problems[0].reason


@pytest.mark.parametrize("algo", sorted(CHECKSUMS))
def test_a_manifest_encoded_once_is_the_canonical_json_of_its_body_and_its_checksum(algo):
    """``build_manifest`` encodes the body once and joins the text around ``manifest_checksum``: the bytes are
    the canonical JSON (sorted keys, no spaces) of the decoded manifest, and its checksum is the digest of the
    canonical JSON of everything else -- with and without remote entries and metadata."""
    from moe_ft.store.manifest import EntryRecord, TensorRecord, _digest, build_manifest

    t = (TensorRecord("w", "float32", (2, 3), 24), TensorRecord('q"\u00e9\\', "int64", (), 8))
    entries = [EntryRecord(4, OperatorId.expert_op(0, e), Level.FULL, f"b{e}", 100 + e, "ab" * 8, t) for e in range(3)]
    entries += [EntryRecord(4, OperatorId.dense(1), Level.COMPUTE, "d\u00e9", 3, "01" * 8, t[:1])]
    meta = EntryRecord(4, None, None, "_meta.ent", 50, "cd" * 8 + "-\u00e9", ())  # not plain: encoded
    remote = [EntryRecord(4, OperatorId.expert_op(1, 0), Level.FULL, "r", 7, "ef" * 8, t)]
    for args in [(entries, meta), (entries, None, remote), ([], None), ([], meta, remote)]:
        data, record = build_manifest(4, algo, *args)
        body = json.loads(data)
        assert data == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        # each entry as its record spells itself (the encoder builds the text from remembered parts)
        assert body["entries"] == [e.to_json() for e in sorted(args[0], key=lambda e: e.op)]
        assert body["meta"] == (meta.to_json() if args[1] else None)
        assert body.get("remote", []) == [dict(e.to_json()) for e in (args[2] if len(args) > 2 else [])]
        assert body["writer"] == record.writer and body["created_unix"] == record.created_unix
        stored = body.pop("manifest_checksum")
        assert stored == _digest(body, algo)
