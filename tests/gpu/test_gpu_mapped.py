"""GPU snapshots into the store's own regions (moe_ft/snapshot/mapped.py): the device-to-host copy lands
in the arena's page-locked mapping, the mfh64 digest is computed on the device, and the trainer's host
threads touch no payload byte. The snapshot of ``t`` holds the state at ``submit(t)`` bitwise, reads back
verified, a remote entry records the digest its peers will rebuild, a flipped bit is caught, and neither
``submit`` nor ``wait_copied`` synchronises the host."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import time

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.state.operators import Level
from moe_ft.store import KeepAll, StoreConfig
from moe_ft.store.codec import write_entry
from moe_ft.store.errors import CorruptEntryError
from moe_ft.store.manifest import entry_key
from tests.gpu._results import record
from tests.gpu.test_gpu_snapshot import host_state, no_host_sync, optimizer_step, small_registry
from tools.bench.gpu_snapshot import sparse_plan

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture
def shm_path(tmp_path):
    """A directory on a tmpfs (where the store lives by default and the arena's file mappings can be
    page-locked), whatever filesystem pytest's own temporary directory is on."""
    if _filesystem(tmp_path) == "tmpfs" or not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="moe-ft-gpu-test-", dir="/dev/shm")
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _filesystem(path) -> str:
    """The type of the filesystem that holds ``path`` (the longest mount point above it in /proc/mounts)."""
    path, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def mapped_engine(root, registry, job="j", piece=0, copy_by="dma", require_mapped=True):
    store = StoreConfig(root=str(root), job_id=job, rank=0, checksum="mfh64").build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2, copy_piece_bytes=piece, copy_by=copy_by), registry, store)
    if require_mapped:
        assert engine.mapped is not None, engine.mapped_off
    return engine, store


@pytest.mark.parametrize("piece,copy_by,agent", [(0, "dma", False), (1 << 16, "dma", False), (0, "kernel", False),
                                                (0, "kernel", True)],
                         ids=["one-copy", "paced", "kernel-copy", "kernel-copy-agent-publishes"])
def test_mapped_snapshots_hold_the_state_at_submit(shm_path, piece, copy_by, agent):
    """Agent publishes: the node agent seals and publishes each point (``--ft-publish-by agent``)."""
    registry = small_registry()
    engine, store = mapped_engine(shm_path, registry, piece=piece, copy_by=copy_by)
    if agent:
        from moe_ft.agent.publish import AgentPublisher

        publisher = AgentPublisher(store, rank=0, agent_dir=shm_path / "agent")
    assert engine.mapped.copy_by == copy_by
    assert (engine.mapped.pacer is not None) == bool(piece)
    assert engine.buffers.arena_bytes == 0  # no slot buffers: the store's regions are the buffers
    recs = _snapshots_hold_the_state(engine, store, registry)
    assert engine.mapped.copy_by == copy_by and not engine.mapped.pinned.failed
    host_state_bytes = sum(t.nbytes for op in registry for t in registry[op].tensors(Level.FULL).values()
                           if not t.is_cuda)
    assert all(r.device_stall_s is not None for r in recs)
    assert max(r.host_bytes_touched for r in recs) <= 2 * host_state_bytes  # the CPU step counters only
    if agent:
        assert publisher.published == len(store.points()) > 0
        publisher.close()
    record("mapped_correctness" + ("_paced" if piece else "") + ("_kernel" if copy_by == "kernel" else "")
           + ("_agent" if agent else ""), {
        "trainer_payload_bytes_per_byte_max": max(r.trainer_payload_bytes_per_byte for r in recs),
        "host_stall_max_ms": 1e3 * max(r.stall_s for r in recs),
        "device_stall_max_ms": 1e3 * max(r.device_stall_s for r in recs),
        "issue_ms_median": 1e3 * sorted(r.issue_s for r in recs)[len(recs) // 2],
        "thread_cpu_ms_median": 1e3 * sorted(r.thread_cpu_s for r in recs)[len(recs) // 2]})


def test_an_arena_that_cannot_be_page_locked_still_snapshots_bitwise():
    """A store directory whose file mappings the kernel refuses to pin (not a tmpfs: an overlay or disk
    filesystem): the refusal is said in one line, no later CUDA call fails for it (the runtime's last error
    is cleared), and the snapshots read back bitwise."""
    root = pathlib.Path(tempfile.mkdtemp(prefix=".moe-ft-gpu-test-", dir=os.getcwd()))
    try:
        if _filesystem(root) == "tmpfs":
            pytest.skip("the repository is on a tmpfs here: no filesystem at hand refuses to pin file mappings")
        registry = small_registry()
        engine, store = mapped_engine(root, registry, copy_by="kernel", require_mapped=False)
        _snapshots_hold_the_state(engine, store, registry)
        failed = engine.mapped.pinned.failed if engine.mapped is not None else engine.mapped_off
        assert "cudaHostRegister" in failed, failed
        torch.zeros(1, device="cuda").add_(1).item()  # nothing left pending on this thread
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_refused_registration_leaves_no_cuda_error_behind():
    """``host_register.register`` of memory that is page-locked already: the runtime refuses it (wherever the
    tests run), the reason comes back, and the next CUDA call on this thread succeeds."""
    from moe_ft.snapshot import host_register

    buf = torch.empty(1 << 20, dtype=torch.uint8)
    assert host_register.register(buf.data_ptr(), buf.nbytes) == ""
    try:
        why = host_register.register(buf.data_ptr(), buf.nbytes)
        assert "cudaHostRegister" in why and "cudaError" in why, why
        assert torch.zeros(4, device="cuda").add_(1).sum().item() == 4.0
    finally:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _snapshots_hold_the_state(engine, store, registry) -> list:
    """Eight sparse snapshots, the state changed after each; every point read back bitwise (the remote
    entries' digests as the peers will rebuild them). Returns the engine's records."""
    ops = list(registry)
    x = torch.randn(4096, 4096, device="cuda")
    expected, remote = {}, {}
    try:
        for it in range(8):
            plan = sparse_plan(ops, it, 3)
            fulls = [op for op, lvl in plan.items() if lvl == Level.FULL]
            rem = frozenset(fulls[:2]) if it % 2 else frozenset()  # FULL entries left to the peers
            expected[it] = host_state(registry, plan)
            remote[it] = {op: {n: t.detach().cpu().clone() for n, t in registry[op].tensors(Level.FULL).items()}
                          for op in rem}
            counter = torch.full((4,), float(it), device="cuda")
            engine.submit(it, plan, {"iteration": it}, {"counter": counter}, remote=rem)
            counter.fill_(-1.0)
            for _ in range(10):
                x @ x
            engine.wait_copied()
            optimizer_step(registry)
        engine.flush()
    finally:
        engine.close()
    for it, state in expected.items():
        assert store.verify([it]).problems == ()
        point = store.catalog([it]).point(it)
        for op, tensors in state.items():
            if op in remote[it]:  # the digest the peers' rebuilt entry must match (written on the host here)
                want = write_entry(lambda b: None, entry_key(it, op, Level.FULL), remote[it][op], "mfh64")
                got = point.entries[op]
                assert got.remote and got.checksum == want.checksum, (it, op)
                continue
            level = Level.FULL if any(n.startswith("master.") for n in tensors) else Level.COMPUTE
            loaded = store.load(it, op, level)
            for name, t in tensors.items():
                assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), (it, op, name)
        assert torch.equal(store.load_meta(it).tensors["counter"], torch.full((4,), float(it)))
    assert all(r.published for r in engine.records)
    return engine.records


def test_mapped_submit_and_wait_copied_never_block_the_host(shm_path):
    registry = small_registry()
    ops = list(registry)
    engine, _ = mapped_engine(shm_path, registry)
    meta_dev = torch.arange(8, device="cuda", dtype=torch.float64)
    try:
        for it in range(6):  # each plan's hash table is built at its first use (a host sync), then reused
            check = no_host_sync() if it >= 2 else _null()
            with check:
                engine.submit(it, sparse_plan(ops, it, 2), {"iteration": it}, {"dev": meta_dev})
                engine.wait_copied()
                optimizer_step(registry)
            engine.flush()
    finally:
        engine.close()
    steady = engine.records[2:]
    assert max(r.stall_s for r in steady) < 0.05
    record("mapped_issue_steady", {"issue_ms_max": 1e3 * max(r.issue_s for r in steady),
                                   "tensors": sum(len(registry[op].tensors(Level.FULL)) for op in ops)})


def test_a_flipped_bit_in_a_mapped_region_is_caught(shm_path):
    registry = small_registry()
    ops = list(registry)
    engine, store = mapped_engine(shm_path, registry)
    try:
        engine.submit(0, {op: Level.FULL for op in ops}, {}, {})
        engine.wait_copied()
        engine.flush()
    finally:
        engine.close()
    op = ops[-1]
    entry = store.catalog([0]).point(0).entries[op]
    path, off, n = store.backend.blob_location(0, entry.blob)
    with open(path, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)[0]
        f.seek(off + n // 2)
        f.write(bytes([b ^ 0x10]))
    with pytest.raises(CorruptEntryError):
        store.load(0, op, Level.FULL)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_read_from_the_device_waits_for_one_piece_of_a_paced_copy():
    """What pacing is for (moe_ft/snapshot/pacing.py): an ``.item()`` on the compute stream right after a
    256 MiB snapshot copy was queued on a side stream returns after one 16 MiB piece, not after the copy."""
    from moe_ft.snapshot.pacing import CopyPacer

    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    x, side = torch.ones(1, device="cuda"), torch.cuda.Stream()
    pacer = CopyPacer(16 << 20)

    def read_behind(paced: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            if paced:
                pacer.copy([dst], [src])
            else:
                dst.copy_(src, non_blocking=True)
            end.record()
        t0 = time.perf_counter()
        x.item()
        waited = time.perf_counter() - t0
        end.synchronize()
        return waited, start.elapsed_time(end) / 1e3

    whole = sorted(read_behind(False) for _ in range(7))[3]
    paced = sorted(read_behind(True) for _ in range(7))[3]
    assert torch.equal(dst[-4096:].cuda(), src[-4096:])
    record("paced_copy_read", {"item_ms_behind_one_copy": 1e3 * whole[0], "item_ms_behind_paced": 1e3 * paced[0],
                               "copy_ms_one": 1e3 * whole[1], "copy_ms_paced": 1e3 * paced[1],
                               "pieces": pacer.pieces})
    assert whole[0] > 0.5 * whole[1]  # the read waited for (most of) the copy
    assert paced[0] < whole[0] / 3 and paced[1] < 1.5 * whole[1]


def test_a_kernel_copy_leaves_the_copy_engine_and_most_sms_free():
    """``--ft-snapshot-copy-by kernel``: a 256 MiB copy into page-locked host memory by the hash kernel on 16
    programs (a side stream) copies every byte with the sums of the reference, and neither an ``.item()`` nor
    a small kernel plus ``.item()`` on the compute stream waits for it (the copy engine is idle and most SMs
    are free), where both wait behind a DMA copy of the same bytes."""
    from moe_ft.snapshot.mapped import _mapped_device_pointer
    from moe_ft.store import entry_hash as eh
    from moe_ft.store.entry_hash_triton import TensorTable

    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    table = TensorTable([src], [0])
    addr = torch.tensor([_mapped_device_pointer(dst.data_ptr())], dtype=torch.int64, device="cuda")
    x, side = torch.ones(1, device="cuda"), torch.cuda.Stream()

    def behind(kernel: bool, probe) -> tuple[float, float]:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            if kernel:
                table.launch(addr, programs=16)
            else:
                dst.copy_(src, non_blocking=True)
            end.record()
        t0 = time.perf_counter()
        probe()
        waited = time.perf_counter() - t0
        end.synchronize()
        return waited, start.elapsed_time(end) / 1e3

    dst.zero_()
    sums = table.launch(addr, programs=16).cpu()
    torch.cuda.synchronize()
    assert torch.equal(dst.cuda(), src) and sums[0].tolist() == eh.lane_sums_of(dst, 0)
    got = {}
    for name, probe in (("item", lambda: x.item()), ("kernel_item", lambda: (x + 1).item())):
        for kernel in (False, True):
            got[(name, kernel)] = sorted(behind(kernel, probe) for _ in range(7))[3]
    record("kernel_copy_read", {f"{name}_ms_behind_{'kernel' if k else 'dma'}": 1e3 * v[0]
                                for (name, k), v in got.items()} | {
        "copy_ms_dma": 1e3 * got[("item", False)][1], "copy_ms_kernel16": 1e3 * got[("item", True)][1]})
    for name in ("item", "kernel_item"):
        assert got[(name, True)][0] < got[(name, False)][0] / 3, (name, got)
