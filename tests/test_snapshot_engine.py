"""Snapshot engine on the CPU path (and one GPU test), without a model: a hand-made registry, a file store on a
temp dir.

What the engine must guarantee (``docs/snapshot.md``): the snapshot of ``t`` holds the state at
``submit(t)`` even when the live tensors change after ``wait_copied()``; metadata tensors are copied at
``submit`` (the caller may reuse them); host buffers are allocated once per slot and reused; the bytes it
reports are exactly those of the plan; every entry is published and verifies on load."""

from __future__ import annotations

import time

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.snapshot.engine import _no_torch_function
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorRegistry, OperatorState
from moe_ft.store import KeepAll, StoreConfig, entry_hash

OPS = [OperatorId.dense(0), OperatorId.gate(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]


def make_registry() -> OperatorRegistry:
    gen = torch.Generator().manual_seed(0)
    states = {}
    for op in OPS:
        states[op] = OperatorState(
            op=op,
            compute={"weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16), "bias": torch.zeros(())},
            master={"master.weight": torch.randn(8, 4, generator=gen)},
            optim={"exp_avg.weight": torch.randn(8, 4, generator=gen), "step": torch.tensor(3, dtype=torch.int64)})
    return OperatorRegistry(states, pp_rank=0, ep_rank=0)


def step(registry: OperatorRegistry) -> None:
    """Stand-in for the optimizer step: modifies every live tensor in place."""
    for op in registry:
        for t in registry[op].tensors(Level.FULL).values():
            t.add_(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_slots,write_threads,direct", [(1, None, False), (2, None, False), (2, 3, False),
                                                            (1, None, True), (2, None, True), (2, 3, True)])
def test_snapshots_hold_the_state_at_submit_and_reuse_buffers(tmp_path, num_slots, write_threads, direct):
    """Both CPU paths: slot buffers (copy, then write) and direct writes of the live tensors (the
    optimizer step may only run once they are written: ``wait_copied``)."""
    registry = make_registry()
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=num_slots, write_threads=write_threads, direct_write=direct),
                            registry, store)
    assert engine.direct is direct
    expected, allocated = {}, []
    try:
        for it in range(10):
            plan = {op: (Level.FULL if (i + it) % 2 else Level.COMPUTE) for i, op in enumerate(OPS)}
            plan[OPS[it % len(OPS)]] = Level.NONE
            expected[it] = {op: {n: t.clone() for n, t in registry[op].tensors(lvl).items()}
                            for op, lvl in plan.items() if lvl != Level.NONE}
            rng = torch.full((5,), float(it))
            record = engine.submit(it, plan, {"iteration": it, "x": [1.5, it]}, {"rng": rng})
            rng.fill_(-1.0)  # the caller reuses its tensor at once
            assert record.bytes == registry.nbytes(plan)
            assert (record.num_full, record.num_compute) == (sum(l == Level.FULL for l in plan.values()),
                                                             sum(l == Level.COMPUTE for l in plan.values()))
            engine.wait_copied()
            step(registry)  # the next optimizer step; must not leak into snapshot ``it``
            if it >= 6:  # every (slot, operator, level) has been seen by now
                allocated.append(engine.buffers.allocated_bytes)
        engine.flush()
    finally:
        engine.close()
    assert len(set(allocated)) == 1, f"host buffers were reallocated: {allocated}"
    assert store.points() == list(range(10))
    full = sum(registry[op].nbytes(Level.FULL) for op in OPS)
    # every operator FULL (slot buffers only) + the metadata tensor
    assert allocated[0] == num_slots * ((0 if direct else full) + 5 * 4)
    for it, ops in expected.items():
        catalog = store.verify([it])
        assert catalog.problems == ()
        for op, tensors in ops.items():
            level = Level.FULL if "master.weight" in tensors else Level.COMPUTE
            loaded = store.load(it, op, level)
            assert set(loaded) == set(tensors)
            for name, t in tensors.items():
                assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), (it, op, name)
        meta = store.load_meta(it)
        assert meta.meta == {"iteration": it, "x": [1.5, it]}
        assert torch.equal(meta.tensors["rng"], torch.full((5,), float(it)))
    assert all(r.published and r.thread_cpu_s >= 0 for r in engine.records)


@pytest.mark.timeout(60)
def test_engine_error_surfaces_on_the_training_thread(tmp_path):
    registry = make_registry()
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2), registry, store)
    try:
        engine.submit(0, {OPS[0]: Level.FULL}, {"bad": object()}, {})  # not JSON-serialisable
        with pytest.raises(RuntimeError, match="snapshot engine failed"):
            engine.wait_copied()
            engine.flush()
    finally:
        with pytest.raises(RuntimeError):
            engine.close()
    assert store.points() == []


@pytest.mark.timeout(60)
def test_host_buffers_are_allocated_at_build_for_the_largest_plan(tmp_path):
    """Every operator's FULL tensors get their buffers when the engine is built (views of one arena per
    slot); submitting any plan allocates nothing for operators. On CPU nothing is pinned and there is no
    device stall to report."""
    registry = make_registry()
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2, direct_write=False), registry, store)
    full = sum(registry[op].nbytes(Level.FULL) for op in OPS)
    try:
        assert not engine.cuda and engine.buffers.allocated_bytes == 2 * full
        assert engine.buffers.arena_bytes >= full
        for slot in range(2):
            for op in OPS:
                for name, t in registry[op].tensors(Level.FULL).items():
                    buf = engine.buffers.view(slot, f"{op}/{name}")
                    assert buf.shape == t.shape and buf.dtype == t.dtype and buf.is_contiguous()
                    assert buf.data_ptr() % 64 == 0 and not buf.is_pinned()
        engine.submit(0, {op: Level.FULL for op in OPS}, {}, {})
        engine.wait_copied()
        engine.flush()
        assert engine.buffers.allocated_bytes == 2 * full
        assert engine.records[0].device_stall_s is None and engine.records[0].copy_s > 0
    finally:
        engine.close()


def test_direct_writes_are_the_cpu_default_and_refused_where_they_cannot_work(tmp_path):
    """On CPU the engine writes live tensors by default (no operator buffers at all); a bubble schedule
    needs slot buffers, so asking for both is an error naming the fix."""
    from moe_ft.snapshot.bubbles import BubbleGate, BubbleSchedule

    registry = make_registry()
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(), registry, store)
    try:
        assert engine.direct and engine.buffers.arena_bytes == 0 and engine.buffers.allocated_bytes == 0
        engine.submit(0, {op: Level.FULL for op in OPS}, {}, {})
        assert engine.wait_copied() >= 0 and engine.records[0].copy_s > 0
        engine.flush()
        assert store.verify([0]).problems == ()
    finally:
        engine.close()
    bubbles = BubbleSchedule(gate=BubbleGate())
    with pytest.raises(ValueError, match="direct_write needs .* no bubble schedule"):
        SnapshotEngine(EngineConfig(bubbles=bubbles, direct_write=True), registry, store)


def test_no_torch_function_is_a_null_context_when_disabled():
    with _no_torch_function(False):
        assert torch.ones(2).sum().item() == 2.0
    with _no_torch_function(True):
        assert torch.ones(2).sum().item() == 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct,checksum,passes", [(True, "xxh3_64", 2), (False, "xxh3_64", 3), (True, "mfh64", 1),
                                                     (False, "mfh64", 2)])
def test_the_trainers_host_passes_over_the_snapshot_bytes_are_counted(tmp_path, direct, checksum, passes):
    """``trainer_payload_bytes_per_byte``: the CPU direct path checksums and writes each byte (2 passes) or, into
    the arena with ``mfh64`` and moe-ft's C extension, copies it with a copy that hashes (1); the slot path
    copies it into a buffer first (one more); headers add a few bytes on large entries."""
    if checksum == "mfh64" and not entry_hash.NATIVE:
        pytest.skip("moe-ft's C extension is not built (no C compiler)")
    gen = torch.Generator().manual_seed(1)
    registry = OperatorRegistry({op: OperatorState(op=op, compute={"weight": torch.randn(256, 256, generator=gen)},
                                                   master={}, optim={"exp_avg.weight": torch.randn(256, 256, generator=gen)})
                                 for op in OPS}, pp_rank=0, ep_rank=0)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum=checksum).build(retention=KeepAll())
    assert store.copies_hashing == (checksum == "mfh64")
    engine = SnapshotEngine(EngineConfig(direct_write=direct), registry, store)
    try:
        for it in range(2):
            engine.submit(it, {op: Level.FULL for op in OPS}, {"iteration": it}, {})
            engine.wait_copied()
        engine.flush()
    finally:
        engine.close()
    for record in engine.records:
        assert record.published and passes <= record.trainer_payload_bytes_per_byte < passes + 0.01, record


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [False, True])
def test_state_the_next_forward_writes_is_captured_at_submit(tmp_path, direct):
    """TE's delayed scaling rolls ``fp8_meta`` amax histories and scales in place when the next forward's
    FP8 region ends, and the router's expert bias moves when its gradients are finalized: both before the
    optimizer step that ``wait_copied`` guards. Such tensors (``OperatorState.forward_mutated``) are captured
    when the snapshot is submitted; the other tensors of the entry as before."""
    registry = make_registry()
    amax = {op: torch.arange(12, dtype=torch.float32).reshape(3, 4) for op in OPS}
    for op in OPS:
        registry[op].compute["fp8_meta.scaling_fwd.amax_history"] = amax[op]
        registry[op].forward_mutated.add("fp8_meta.scaling_fwd.amax_history")
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=2, direct_write=direct), registry, store)
    at_submit = {}
    try:
        for it in range(4):
            plan = dict.fromkeys(OPS, Level.COMPUTE)
            at_submit[it] = {op: amax[op].clone() for op in OPS}
            engine.submit(it, plan, {"iteration": it}, {})
            for op in OPS:  # the next forward, before the copy of ``it`` is done
                amax[op].copy_(amax[op].roll(1, 0)).add_(100.0)
            engine.wait_copied()
            step(registry)
        engine.flush()
    finally:
        engine.close()
    for it in range(4):
        for op in OPS:
            got = store.load(it, op, Level.COMPUTE)["fp8_meta.scaling_fwd.amax_history"]
            assert torch.equal(got, at_submit[it][op]), (it, op)
            assert not torch.equal(got, at_submit[it][op].roll(1, 0) + 100.0)


def _cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second of device time on this GPU (measured with timing events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10 ** 7)
    end.record()
    end.synchronize()
    return 10 ** 7 / (start.elapsed_time(end) / 1e3)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,checksum", [("files", "xxh3_64"), ("arena", "mfh64")])
def test_the_background_thread_sleeps_while_the_copy_waits_on_the_device(tmp_path, layout, checksum):
    """GPU (slot buffers on the file layout; the arena's mapped regions where Triton is installed): the background
    thread waits on each snapshot's copy event. The compute stream is kept busy for 0.4 s before ``submit``, so
    the copy queued behind it ends ~0.4 s later; a default event's ``synchronize`` would spin a core all that time
    (its CPU ~ the wait), a blocking one sleeps. The point is published as ever."""
    gen = torch.Generator().manual_seed(2)
    registry = OperatorRegistry({op: OperatorState(
        op=op, compute={"weight": torch.randn(256, 256, generator=gen).cuda()}, master={},
        optim={"exp_avg.weight": torch.randn(256, 256, generator=gen).cuda()}) for op in OPS}, pp_rank=0, ep_rank=0)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, layout=layout, checksum=checksum).build(
        retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(), registry, store)
    plan = {op: Level.FULL for op in OPS}
    try:
        assert engine.cuda
        engine.submit(0, plan, {"iteration": 0}, {})  # first use: pinning, the hash kernel's compilation
        engine.wait_copied()
        engine.flush()
        cycles = int(0.4 * _cycles_per_second())
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        record = engine.submit(1, plan, {"iteration": 1}, {})
        engine.wait_copied()
        engine.flush()
        waited = time.perf_counter() - start
    finally:
        engine.close()
    assert waited > 0.3, f"the copy did not wait for the busy compute stream ({waited:.3f} s)"
    assert record.published and record.thread_cpu_s < waited / 4, (record, waited)
    assert store.verify([1]).problems == ()
    for op in OPS:
        loaded = store.load(1, op, Level.FULL)
        assert all(torch.equal(loaded[n], t.cpu()) for n, t in registry[op].tensors(Level.FULL).items())
