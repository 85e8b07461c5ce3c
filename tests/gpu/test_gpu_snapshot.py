"""Snapshot engine on CUDA: page-locked buffers allocated at build, copies on a side
stream, the compute stream (not the host) waits for them, the snapshot of ``t`` holds the state at
``submit(t)`` bitwise, no host synchronisation in ``submit``/``wait_copied``; D2H bandwidth against a
plain pinned copy (recorded; asserted only against a floor a pageable copy would miss)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.state.operators import Level
from moe_ft.store import KeepAll, StoreConfig
from tests.gpu._results import record
from tools.bench.gpu_snapshot import engine_bandwidth, pinned_bandwidth, sparse_plan, synthetic_registry

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@contextlib.contextmanager
def no_host_sync():
    """Any CUDA call that synchronises the host raises inside this block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def small_registry():
    return synthetic_registry(layers=2, hidden=256, ffn=1024, experts=4, vocab=512)


def host_state(registry, plan) -> dict:
    return {op: {n: t.detach().cpu().clone() for n, t in registry[op].tensors(lvl).items()}
            for op, lvl in plan.items() if lvl != Level.NONE}


def optimizer_step(registry) -> None:
    """Stand-in for the optimizer step, queued on the compute stream: changes every live tensor."""
    live = [t for op in registry for t in registry[op].tensors(Level.FULL).values()]
    torch._foreach_add_([t for t in live if t.is_cuda], 1.0)
    for t in live:
        if not t.is_cuda:
            t.add_(1.0)


@pytest.mark.parametrize("busy", [False, True], ids=["step-right-after", "compute-in-between"])
def test_cuda_snapshots_hold_the_state_at_submit(tmp_path, busy):
    registry = small_registry()
    ops = list(registry)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2), registry, store)
    full = sum(registry[op].nbytes(Level.FULL) for op in ops)
    assert engine.cuda and engine.buffers.allocated_bytes == 2 * full  # every operator FULL, at build
    key = f"{ops[0]}/{next(iter(registry[ops[0]].tensors(Level.FULL)))}"
    assert engine.buffers.view(0, key).is_pinned()
    x = torch.randn(4096, 4096, device="cuda")
    expected, counters = {}, {}
    try:
        for it in range(8):
            plan = sparse_plan(ops, it, 3)
            expected[it] = host_state(registry, plan)
            counter = torch.full((4,), float(it), device="cuda")
            engine.submit(it, plan, {"iteration": it}, {"counter": counter, "rng": torch.get_rng_state()})
            counter.fill_(-1.0)  # the caller reuses its device tensor at once (queued on the compute stream)
            counters[it] = float(it)
            if busy:  # forward/backward stand-in, overlapping the copy
                for _ in range(20):
                    x @ x
            engine.wait_copied()
            optimizer_step(registry)  # queued behind the copy of `it` on the device only
        engine.flush()
    finally:
        engine.close()
    for it, state in expected.items():
        assert store.verify([it]).problems == ()
        for op, tensors in state.items():
            level = Level.FULL if any(n.startswith("master.") for n in tensors) else Level.COMPUTE
            loaded = store.load(it, op, level)
            for name, t in tensors.items():
                assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), (it, op, name)
        assert torch.equal(store.load_meta(it).tensors["counter"], torch.full((4,), counters[it]))
    recs = engine.records
    assert all(r.published and r.device_stall_s is not None and r.copy_s > 0 for r in recs)
    record(f"engine_correctness_{'busy' if busy else 'idle'}", {
        "host_stall_max_ms": 1e3 * max(r.stall_s for r in recs),
        "device_stall_max_ms": 1e3 * max(r.device_stall_s for r in recs),
        "issue_ms_max": 1e3 * max(r.issue_s for r in recs)})


def test_submit_and_wait_copied_never_block_the_host(tmp_path):
    registry = small_registry()
    ops = list(registry)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2), registry, store)
    meta_dev = torch.arange(8, device="cuda", dtype=torch.float64)
    try:
        engine.submit(0, sparse_plan(ops, 0, 2), {}, {"dev": meta_dev})  # first use allocates meta buffers
        engine.wait_copied()
        engine.flush()
        for it in range(1, 5):
            with no_host_sync():
                engine.submit(it, sparse_plan(ops, it, 2), {"iteration": it}, {"dev": meta_dev})
                engine.wait_copied()
                optimizer_step(registry)
            engine.flush()  # a free slot for the next submit: the store is not what is measured here
    finally:
        engine.close()
    assert max(r.stall_s for r in engine.records[1:]) < 0.05


def test_d2h_bandwidth_against_a_pinned_copy(tmp_path):
    registry = synthetic_registry(layers=1, hidden=1024, ffn=4096, experts=8, vocab=32768)
    pinned = pinned_bandwidth(registry, 5)
    engine = engine_bandwidth(registry, str(tmp_path), 4)
    ratio = engine["engine_gbps"] / pinned["pinned_copy_gbps"]
    record("d2h_bandwidth", dict(pinned, **engine, engine_vs_pinned=ratio))
    # a pageable-memory copy runs at a fraction of the pinned rate; the goal itself is 0.8 (recorded)
    assert ratio > 0.5, (pinned, engine)
