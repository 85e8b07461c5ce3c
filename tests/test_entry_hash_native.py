"""The C build of the ``mfh64`` lane sums (``moe_ft/store/_mfh64.c``) against the NumPy reference, bit for bit,
and its copy that hashes: the bytes it writes are the source's, the sums are those of the source, every
single-bit flip of the source changes them, and bad arguments are refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ft.store import entry_hash as eh

pytestmark = pytest.mark.skipif(not eh.NATIVE, reason="moe-ft's C extension is not built (no C compiler)")

SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 63, 4096 + 3, 3 * 65536 * 4 + 6]
FIRSTS = [0, 9, (1 << 32) - 2, (1 << 40) + 5]  # word indices wrap mod 2^32


def reference(data: bytes, first: int) -> list[int]:
    return eh._lane_sums_numpy(np.frombuffer(data + bytes(-len(data) % 4), dtype="<u4"), first)


@pytest.mark.parametrize("n", SIZES)
def test_the_c_sums_equal_the_numpy_reference(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    for first in FIRSTS:
        want = reference(data.tobytes(), first)
        assert eh._lane_sums_host(data.view("<u4") if n % 4 == 0 else np.frombuffer(
            data.tobytes() + bytes(-n % 4), dtype="<u4"), first) == want
        assert eh.lane_sums_of(torch.from_numpy(data.copy()), first) == want


@pytest.mark.parametrize("n", SIZES)
def test_the_copy_writes_the_source_and_returns_its_sums(n):
    src = torch.from_numpy(np.random.default_rng(n + 1).integers(0, 256, n, dtype=np.uint8))
    region = torch.full((n + 8,), 0xAB, dtype=torch.uint8)  # bytes around the destination stay untouched
    for first in FIRSTS:
        sums = eh.copy_lane_sums(src, region[4:4 + n], first)
        assert sums == reference(src.numpy().tobytes(), first)
        assert torch.equal(region[4:4 + n], src)
        assert region[:4].eq(0xAB).all() and region[4 + n:].eq(0xAB).all()


def test_tensors_of_any_dtype_are_copied_as_their_bytes():
    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(33, 7, generator=g).bfloat16(), torch.randn(5, generator=g).double(),
              torch.randint(0, 2, (13,), generator=g).bool()):
        dst = torch.empty(t.nbytes, dtype=torch.uint8)
        assert eh.copy_lane_sums(t, dst, 11) == eh.lane_sums_of(t, 11)
        assert torch.equal(dst.view(t.dtype).view(t.shape), t)


def test_every_single_bit_flip_of_the_source_changes_both_sums():
    src = torch.from_numpy(np.random.default_rng(7).integers(0, 256, 41, dtype=np.uint8))  # 10 words and a tail
    dst = torch.empty_like(src)
    clean = eh.copy_lane_sums(src, dst, 3)
    for byte in range(src.numel()):
        for bit in range(8):
            src[byte] ^= 1 << bit
            flipped = eh.copy_lane_sums(src, dst, 3)
            src[byte] ^= 1 << bit
            assert flipped[0] != clean[0] and flipped[1] != clean[1], (byte, bit)


def test_bad_arguments_are_refused():
    src = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8 bytes, destination of 4"):
        eh.copy_lane_sums(src, torch.zeros(4, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        eh.copy_lane_sums(src, torch.zeros(2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        eh.copy_lane_sums(src, torch.zeros(16, dtype=torch.uint8)[::2], 0)
    readonly = np.zeros(8, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises((TypeError, BufferError)):  # a read-only destination is not written
        eh._native.copy_lane_sums(np.zeros(8, dtype=np.uint8), readonly, 0)


def test_the_cpu_snapshot_store_takes_mfh64_on_the_arena_only():
    """``--ft-store-checksum auto``: a CPU registry on the arena hashes as it copies (mfh64); the files layout
    keeps the store's default; CUDA is unchanged (mfh64 on the arena with direct writes, hashed on the device)."""
    from moe_ft.snapshot.mapped import store_checksum

    assert store_checksum(False, "arena", True, False) == eh.ALGO
    assert store_checksum(False, "arena", False, True) == eh.ALGO  # slot buffers, bubble-aware: one more pass
    assert store_checksum(False, "files", True, False) is None
    assert store_checksum(True, "files", True, False) is None


def test_the_host_bandwidth_bench_reports_every_path(capsys):
    import json

    from tools.bench import mfh64_host

    assert mfh64_host.main(["--mb", "1", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["native"] is True
    assert all(out[k] > 0 for k in ("memcpy_gbps", "xxh3_64_gbps", "mfh64_numpy_gbps", "mfh64_c_gbps",
                                    "copy_mfh64_c_gbps"))
