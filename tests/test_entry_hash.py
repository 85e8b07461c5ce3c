"""The ``mfh64`` entry checksum: its PyTorch reference against an independent pure-Python oracle written
from the definition, the Triton kernel against the reference bit for bit (``TRITON_INTERPRET=1`` on CPU,
set by conftest; on CUDA when there is one), and the detection guarantees the definition claims."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from moe_ft.store import entry_hash as eh
from moe_ft.store import entry_hash_triton as et

M = 0xFFFFFFFF


def oracle(data: bytes) -> bytes:
    """The definition, word by word, in Python integers."""

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & M
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & M
        return x ^ (x >> 16)

    padded = data + b"\0" * (-len(data) % 4)
    sums = [0, 0]
    for i, (w,) in enumerate(struct.iter_unpack("<I", padded)):
        for lane, (k, s) in enumerate([(0x9E3779B1, 0x7F4A7C15), (0x85EBCA77, 0x165667B1)]):
            sums[lane] = (sums[lane] + fmix(w ^ ((i * k + s) & M))) & M
    return struct.pack("<QII", len(data), *sums)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(0, 256, (n * torch.tensor([], dtype=dtype).element_size(),), generator=g,
                         dtype=torch.uint8).view(dtype)


CASES = [(0, torch.uint8), (1, torch.uint8), (3, torch.bool), (7, torch.int8), (4097, torch.float32),
         (3 * 4096 + 5, torch.bfloat16), (1000, torch.int64), (2 * 4096, torch.float16)]


@pytest.mark.parametrize("n,dtype", CASES)
def test_reference_is_the_definition(n, dtype):
    t = sample(n, dtype)
    assert eh.reference_digest(t) == oracle(raw(t))


@pytest.mark.parametrize("n,dtype", CASES)
def test_kernel_equals_the_reference(n, dtype):
    t = sample(n, dtype, seed=1)
    got = et.device_digest(t, block=1024)  # several blocks and a partial one on the larger cases
    assert got.dtype == torch.int64 and got.shape == (3,)
    assert et.finish(got) == eh.reference_digest(t)


def test_reference_in_chunks_equals_one_pass(monkeypatch):
    t = sample(10_001, torch.uint8, seed=2)
    whole = eh.reference_digest(t)
    monkeypatch.setattr(eh, "CHUNK_WORDS", 7)
    assert eh.reference_digest(t) == whole == oracle(raw(t))


def test_device_path_equals_the_host_path(monkeypatch):
    """The int64 PyTorch path (tail words on a GPU) run on CPU tensors against the NumPy one."""
    monkeypatch.setattr(eh, "CHUNK_WORDS", 1000)
    words = sample(2500, torch.int32, seed=9)
    for first in (0, 7, (1 << 32) - 3):  # indices wrap mod 2^32
        assert eh._lane_sums_torch(words, first).tolist() == eh.lane_sums(words, first).tolist()


@pytest.mark.parametrize("n,dtype", CASES)
def test_a_host_tensors_share_at_any_index_equals_the_word_path(n, dtype):
    """``lane_sums_of`` of a CPU tensor (NumPy on its bytes in place) against the words-and-tail path."""
    t = sample(n, dtype, seed=5)
    for first in (0, 7, (1 << 32) - 3):
        words, tail = eh.split_words(eh.byte_view(t))
        want = (eh.lane_sums(words, first) + eh.lane_sums(tail, first + words.numel())) & eh.MASK
        assert eh.lane_sums_of(t, first) == want.tolist()


def test_views_and_layouts():
    base = sample(4096 + 9, torch.uint8, seed=3)
    shifted = base[1:]  # starts mid-word: hashed through an aligned copy
    assert eh.reference_digest(shifted) == oracle(raw(shifted)) == et.finish(et.device_digest(shifted))
    matrix = sample(64 * 33, torch.float32, seed=4).reshape(64, 33)
    assert eh.reference_digest(matrix.t()) == oracle(raw(matrix.t()))  # non-contiguous: its logical order
    with pytest.raises(TypeError, match="dense strided"):
        eh.reference_digest(torch.eye(3).to_sparse())


def test_every_single_bit_flip_is_detected_by_kernel_and_reference():
    t = sample(40, torch.uint8, seed=5)  # 10 words: 320 flips
    clean = eh.reference_digest(t)
    flat = t.clone()
    for byte in range(flat.numel()):
        for bit in range(8):
            flat[byte] ^= 1 << bit
            kernel = et.finish(et.device_digest(flat))
            assert kernel == eh.reference_digest(flat) != clean, (byte, bit)
            assert kernel[8:12] != clean[8:12] and kernel[12:] != clean[12:]  # both lanes, as the proof says
            flat[byte] ^= 1 << bit
    assert eh.reference_digest(flat) == clean


def test_larger_entry_flips_swaps_and_truncation():
    t = sample(1 << 20, torch.uint8, seed=6)
    clean = eh.reference_digest(t)
    g = torch.Generator().manual_seed(7)
    for pos in torch.randint(0, t.numel(), (64,), generator=g).tolist():
        bad = t.clone()
        bad[pos] ^= 1 << (pos % 8)
        assert eh.reference_digest(bad) != clean, pos
    words = t.view(torch.int32).clone()
    words[[10, 20]] = words[[20, 10]]  # two words swapped: the sum alone would not see it
    assert words[10] != words[20] and eh.reference_digest(words) != clean
    assert eh.reference_digest(t[:-4]) != clean and eh.reference_digest(t[:-4])[:8] == struct.pack("<Q", t.numel() - 4)
    zeros = torch.zeros(4096, dtype=torch.uint8)
    assert eh.reference_digest(zeros) != eh.reference_digest(torch.zeros(4100, dtype=torch.uint8))


def test_the_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        et.device_digest(torch.zeros(8, dtype=torch.uint8))


@pytest.mark.gpu
def test_kernel_on_cuda_equals_the_host_reference():
    for n, dtype in [*CASES, (64 << 20, torch.bfloat16)]:
        t = sample(n, dtype, seed=8)
        assert et.finish(et.device_digest(t.cuda())) == eh.reference_digest(t), (n, dtype)


def test_one_launch_for_many_tensors_equals_the_reference_at_their_offsets():
    """``TensorTable``: every tensor's share of its entry's digest (words keyed from its first index), in one
    launch over blocks of all tensors; the single-tensor path for what the table does not take."""
    ts = [sample(n, dtype, seed=i) for i, (n, dtype) in enumerate(CASES) if n and n * torch.tensor(
        [], dtype=dtype).element_size() % 4 == 0]
    firsts = [0, 17, (1 << 32) - 5, 1000][:len(ts)] + [3] * max(0, len(ts) - 4)
    got = et.TensorTable(ts, firsts, block=512).launch()
    for t, f, g in zip(ts, firsts, got):
        assert g.tolist() == eh.lane_sums_of(t, f), (t.dtype, t.numel(), f)
    odd = sample(7, torch.int8, seed=5)
    assert not et.tableable(odd)
    assert et.device_lane_sums(odd, 9).tolist() == eh.lane_sums_of(odd, 9)
    with pytest.raises(ValueError, match="aligned"):
        et.TensorTable([odd], [0])


@pytest.mark.parametrize("programs", [0, 1, 3])
def test_one_launch_copies_the_words_it_hashes(programs):
    """``TensorTable.launch(dst)``: the kernel stores each word it hashed at the tensor's destination (0: hashed
    only), with the same sums; on fewer programs than blocks each program takes every ``programs``-th block."""
    ts = [sample(n, dtype, seed=i) for i, (n, dtype) in enumerate(CASES) if n and n * torch.tensor(
        [], dtype=dtype).element_size() % 4 == 0]
    firsts = [5 * i + (1 << 32) - 9 for i in range(len(ts))]
    outs = [torch.full_like(t, 0) for t in ts]
    skip = len(ts) // 2
    addrs = torch.tensor([0 if i == skip else o.data_ptr() for i, o in enumerate(outs)], dtype=torch.int64)
    table = et.TensorTable(ts, firsts, block=64)
    assert table.num_blocks > 3
    got = table.launch(addrs, programs=programs)
    for i, (t, f, g) in enumerate(zip(ts, firsts, got)):
        assert g.tolist() == eh.lane_sums_of(t, f), (t.dtype, t.numel())
        copied = torch.equal(outs[i].view(torch.uint8), t.view(torch.uint8))
        assert copied == (i != skip) or not t.view(torch.uint8).any(), i
    with pytest.raises(ValueError, match="int64 addresses"):
        table.launch(addrs[:-1])
    with pytest.raises(ValueError, match="programs must be >= 0"):
        table.launch(addrs, programs=-1)


_COMPILE_FOR_HOPPER = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ft.store import entry_hash_triton as et
from moe_ft.store.entry_hash import KEYS
(k0, s0), (k1, s1) = KEYS
sig = {name: "*i64" for name in ("addr_ptr", "dst_ptr", "nwords_ptr", "first_ptr", "blk_tensor_ptr", "blk_start_ptr",
                                 "partial_ptr")}
sig.update(num_blocks="i32", K0="constexpr", S0="constexpr", K1="constexpr", S1="constexpr", BLOCK="constexpr",
           COPY="constexpr")
stores = {}
for copy in (False, True):
    src = ASTSource(fn=et._table_lane_sums_kernel, signature=sig,
                    constexprs=dict(K0=k0, S0=s0, K1=k1, S1=s1, BLOCK=et.BLOCK, COPY=copy))
    stores[str(copy)] = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"].count("st.global")
print(json.dumps(stores))
"""


def test_the_table_kernel_compiles_for_a_hopper_gpu():
    """The interpreter runs the kernel's Python; the GPU compiler is stricter (types, the grid-stride loop). Both
    variants compile for sm_90 (H100/H200) with Triton's own ptxas, no GPU needed, and only the copying one
    stores the words (its stores beside the two block sums)."""
    import json
    import subprocess
    import sys

    from tests._ft_helpers import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stores = json.loads(done.stdout.strip().splitlines()[-1])
    assert stores["False"] == 2 and stores["True"] > stores["False"], stores


@pytest.mark.gpu
def test_one_launch_on_cuda_equals_the_host_reference():
    ts = [sample(n, dtype, seed=i) for i, (n, dtype) in enumerate(CASES)]
    firsts = [7 * i + (1 << 32) - 40 for i in range(len(ts))]
    table = [i for i, t in enumerate(ts) if et.tableable(t.cuda())]
    dev = [ts[i].cuda() for i in table]
    got = et.TensorTable(dev, [firsts[i] for i in table]).launch().cpu()
    for k, i in enumerate(table):
        assert got[k].tolist() == eh.lane_sums_of(ts[i], firsts[i]), CASES[i]
    for i, t in enumerate(ts):
        assert et.device_lane_sums(t.cuda(), firsts[i]).tolist() == eh.lane_sums_of(t, firsts[i]), CASES[i]
