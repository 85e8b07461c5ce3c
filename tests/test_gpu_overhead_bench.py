"""``tools/bench/gpu_overhead.py --interleave K --profile-submit N --profile-worker N --gil-probe --trace-blocks N``:
the in-launch comparison of iterations with and without snapshots, the profiles of the engine's ``submit`` and of
its background thread, the GIL probe and the traced blocks, on the drill's tiny model (one CPU rank)."""

from __future__ import annotations

import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine, SnapshotRecord
from moe_ft.snapshot.engine import _Job
from moe_ft.snapshot.mapped import MappedCopier
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorRegistry, OperatorState
from moe_ft.store import KeepAll, StoreConfig, arena, entry_hash_triton
from moe_ft.store import store as store_module
from tools.bench import gpu_overhead
from tools.bench.block_trace import BlockTracer, summarize, trace_iterations
from tools.bench.gc_times import GcTimes, gc_stats
from tools.bench.gil_probe import GilProbe, lag_stats
from tools.bench.interleave import (
    interleaved_stats,
    iteration_kind,
    last_snapshot_iterations,
    profile_iterations,
    snapshots_paused,
)
from tools.bench.submit_profile import Breakdown, _targets, wrapped
from tools.bench.worker_profile import WorkerProfiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_blocks_alternate_and_a_block_first_iteration_counts_for_neither():
    assert [snapshots_paused(t, 4) for t in range(12)] == [False] * 4 + [True] * 4 + [False] * 4
    assert not any(snapshots_paused(t, 0) for t in range(12))
    # the first iteration of a block holds the submit of its snapshot or the copy of the one before, not both
    assert [iteration_kind(t, 4) for t in (0, 1, 3, 4, 5, 8, 9)] == [None, "active", "active", None, "paused",
                                                                      None, "active"]


def test_interleaved_ratio_is_active_over_paused_medians_without_block_boundaries():
    block = 4
    times = {t: (1.1 if not snapshots_paused(t, block) else 1.0) for t in range(2, 26)}
    for t in range(4, 26, 4):
        times[t] = 100.0  # block-first iterations: mixed, must not count
    stats = interleaved_stats(times, block, hook_s={t: 0.002 if not snapshots_paused(t, block) else 0.001
                                                   for t in times},
                              snapshot_iterations=frozenset(t for t in times if not snapshots_paused(t, block)))
    assert stats["ratio"] == pytest.approx(1.1) and stats["host_s_per_snapshot"] == pytest.approx(0.1)
    assert stats["blocks"] == {"active": 4, "paused": 3}  # 0 (2, 3), 8, 16, 24 (25) / 4, 12, 20
    assert stats["iterations"] == {"active": 2 + 3 + 3 + 1, "paused": 9}
    assert stats["snapshots"]["paused"] == 0 and stats["snapshots"]["active"] == 12
    assert stats["hooks_ms"] == pytest.approx({"active": 2.0, "paused": 1.0})
    assert [b[1] for b in stats["block_medians"]] == ["active", "paused", "active", "paused", "active", "paused",
                                                      "active"]
    assert stats["ratio_ci95"] == pytest.approx([1.1, 1.1])  # every cycle (an active block, the paused one after) alike
    with pytest.raises(ValueError, match="no paused iteration"):
        interleaved_stats({t: 1.0 for t in range(1, 4)}, block)


def test_profiled_iterations_are_the_last_with_snapshots():
    # blocks of 4: 16..19 active, 20..23 paused; iteration 23 has no successor in 24 iterations
    assert profile_iterations(iters=24, warmup=4, block=4, n=1) == ([18], [19])
    assert profile_iterations(iters=24, warmup=4, block=4, n=2) == ([16, 17], [18, 19])
    assert profile_iterations(iters=10, warmup=2, block=0, n=2) == ([5, 6], [7, 8])
    assert profile_iterations(iters=10, warmup=2, block=0, n=0) == ([], [])
    with pytest.raises(ValueError, match="needs 6 iterations"):
        profile_iterations(iters=8, warmup=4, block=4, n=3)
    assert last_snapshot_iterations(iters=24, warmup=4, block=4, n=3, what="w") == [17, 18, 19]
    with pytest.raises(ValueError, match="--profile-worker 9 needs 9"):
        last_snapshot_iterations(iters=24, warmup=4, block=4, n=9, what="--profile-worker 9")


def test_profiling_submit_and_the_worker_in_one_run_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_overhead.main(["--profile-submit", "1", "--profile-worker", "1", "--log-dir", "x"])
    assert "--profile-submit and --profile-worker both replace the store's functions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_overhead.main(["--profile-worker", "1"])  # no --log-dir
    assert "write their tables into --log-dir: name one" in capsys.readouterr().err


def test_skipping_the_default_launch_with_nothing_else_to_launch_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_overhead.main(["--skip-default"])
    assert "--skip-default leaves no snapshot launch" in capsys.readouterr().err


def test_breakdown_times_the_mapped_issue_by_call_path_and_puts_everything_back(tmp_path):
    """The GPU path's sub-steps, on CPU tensors: the engine's entries issued by a :class:`MappedCopier` into an
    arena store (every tensor treated as a device one: copied with ``non_blocking`` and hashed by the table's
    kernel, interpreted here), with every wrapper of the breakdown in place."""
    gen = torch.Generator().manual_seed(0)
    ops = [OperatorId.dense(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]
    registry = OperatorRegistry({op: OperatorState(op=op, compute={"weight": torch.randn(8, 4, generator=gen)},
                                                   optim={"exp_avg.weight": torch.randn(8, 4, generator=gen)})
                                 for op in ops}, pp_rank=0, ep_rank=0)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum="mfh64", layout="arena").build(
        retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=1), registry, store)
    classes = [(store_module.PendingPoint, "reserve_all"), (store_module.PendingPoint, "layout"),
               (store_module.ReservedEntry, "byte_views"), (arena._ArenaWriter, "map_blobs"),
               (entry_hash_triton.TensorTable, "launch")]
    before = [vars(cls)[attr] for cls, attr in classes] + [torch._foreach_copy_, entry_hash_triton.device_lane_sums]
    try:
        engine.mapped = MappedCopier(store, None, on_device=lambda t: True)  # what a CUDA registry gets
        items = [engine._entry(0, op, Level.FULL) for op in ops]
        breakdown = Breakdown()
        breakdown.owner = threading.get_ident()
        with wrapped(_targets(engine), breakdown):
            engine.mapped.issue(0, 0, items, frozenset()).point.abort()
        calls = dict(breakdown.calls)
        assert calls["mapped.issue"] == calls["mapped.issue/reserve_all"] == 1  # every entry's region at once
        assert calls["mapped.issue/reserve_all/layout"] == len(ops)
        assert calls["mapped.issue/byte_views"] == calls["mapped.issue/prep"] == len(ops)
        assert {"mapped.issue/store.begin/has_point", "mapped.issue/store.begin/begin_point",
                "mapped.issue/reserve_all/map_blobs", "mapped.issue/pinned.refresh",
                "mapped.issue/foreach_copy_(non_blocking)", "mapped.issue/hash_plan", "mapped.issue/slot_rows",
                "mapped.issue/hash/table.launch"} <= set(calls)
        # every wrapper is gone again: classes and modules hold their own functions, instances nothing of theirs
        after = [vars(cls)[attr] for cls, attr in classes] + [torch._foreach_copy_, entry_hash_triton.device_lane_sums]
        assert all(a is b for a, b in zip(after, before))
        assert not {"issue", "_hash", "_plan"} & set(vars(engine.mapped))
        assert not {"_entry", "_stage_meta", "_issue_mapped"} & set(vars(engine))
        assert "begin" not in vars(store) and "get" not in vars(engine._free)
    finally:
        engine.mapped = None
        engine.close()


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_tiny_interleaved_launches_pause_snapshots_and_profile_submit(tmp_path, corpus):
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tools.bench.gpu_overhead", "--tiny", "--iters", "24", "--warmup", "4",
           "--windows", "2", "--interleave", "4", "--profile-submit", "1", "--data-path", corpus,
           "--store-root", str(tmp_path), "--log-dir", str(logs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    sparse, none = result["runs"]["sparse(W=2)"][0], result["runs"]["none"][0]
    inter = sparse["interleaved"]
    # every snapshot taken in the measured iterations lies in an active block, and each active block took them
    assert inter["snapshots"]["paused"] == 0 and inter["snapshots"]["active"] == sparse["published"] > 0
    assert not inter["control"] and sparse["whole_windows"]
    assert inter["blocks"]["active"] >= 2 and inter["blocks"]["paused"] >= 2
    assert inter["ratio"] == pytest.approx(inter["active_median_s"] / inter["paused_median_s"])
    assert sparse["median_iter_s"] == inter["active_median_s"]
    # the timings stop where the profiled iterations start (the last active ones: 18, then 19)
    assert sparse["measured_end"] == 18 and sparse["profiled"] == {"breakdown": [18], "profiler": [19], "worker": [], "traced": []}
    assert none["interleaved"]["control"] and none["measured_end"] is None
    assert set(result["interleaved_ratio"]) == {"none", "sparse(W=2)"} and "sparse(W=2)" in result["overhead_ratio"]

    table = (logs / "submit_profile_sparse2_0.txt").read_text()
    assert "Self CPU" in table and "submit of iteration 19" in table
    breakdown = json.loads((logs / "submit_breakdown_sparse2_0.json").read_text())
    paths = {row["path"]: row for row in breakdown["breakdown_per_iteration"]}
    submit = "on_step_end/_snapshot/submit"
    assert {submit, f"{submit}/free_slot", f"{submit}/lay_out", f"{submit}/stage_meta", f"{submit}/worker.submit",
            "on_step_end/_snapshot/capture_step_meta", "on_step_end/_snapshot/policy.plan",
            "on_step_end/popularity.end_iteration", "on_step_end/log_line"} <= set(paths), sorted(paths)
    # self times add up to the inclusive time of the whole on_step_end, submit's to submit's
    assert sum(row["self_ms"] for row in paths.values()) == pytest.approx(paths["on_step_end"]["ms"])
    assert sum(row["self_ms"] for p, row in paths.items() if p.startswith(submit)) == pytest.approx(paths[submit]["ms"])
    assert paths[submit]["calls"] == 1 and paths["on_step_end"]["calls"] == 1 and breakdown["top_ops_per_iteration"]
    assert set(breakdown["issue_ms"]) == {"breakdown", "profiler"}


def _cpu_registry(seed: int) -> tuple[list[OperatorId], OperatorRegistry]:
    gen = torch.Generator().manual_seed(seed)
    ops = [OperatorId.dense(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]
    return ops, OperatorRegistry({op: OperatorState(op=op, compute={"weight": torch.randn(64, 32, generator=gen)},
                                                    optim={"exp_avg.weight": torch.randn(64, 32, generator=gen)})
                                  for op in ops}, pp_rank=0, ep_rank=0)


def _store_functions() -> list:
    return [vars(store_module.PendingPoint)["put"], vars(store_module.PendingPoint)["publish"],
            vars(store_module.ReservedEntry)["seal"], store_module.write_entry, store_module.build_manifest,
            arena._write_index]


def test_worker_profile_times_the_cpu_path_of_the_chosen_snapshots_only(tmp_path):
    """The CPU path (direct writes of the live tensors): the chosen snapshots' sub-steps by call path, in wall
    and thread CPU time, beside the engine's own record; the others untimed; everything put back; the points
    published as without the profile."""
    ops, registry = _cpu_registry(1)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(), registry, store)
    profiler = WorkerProfiler([1, 2], str(tmp_path / "logs"), "t")
    before = _store_functions()
    try:
        profiler.attach(engine)
        for it in range(4):
            engine.submit(it, {op: Level.FULL for op in ops}, {"iteration": it}, {})
            engine.wait_copied()
        engine.flush()
    finally:
        engine.close()
    assert _store_functions() == before and not {"_write", "_pause"} & set(vars(engine)) and "gc" not in vars(store)
    assert store.verify().problems == () and store.points() == [0, 1, 2, 3]
    data = json.loads((tmp_path / "logs" / "worker_breakdown_t.json").read_text())
    assert set(data["snapshots"]) == {"1", "2"} and all(v["published"] for v in data["snapshots"].values())
    rows = {r["path"]: r for r in data["breakdown_per_snapshot"]}
    assert rows["execute"]["calls"] == 1 and rows["execute/write/put/point.put"]["calls"] == len(ops)
    assert {"execute/write/store.begin", "execute/write/put/point.put/write_entry", "execute/write/put_meta",
            "execute/write/publish/build_manifest", "execute/write/publish/commit/write_index",
            "execute/write/publish/after_publish/gc/retention.keep"} <= set(rows)
    assert sum(r["self_ms"] for r in rows.values()) == pytest.approx(rows["execute"]["ms"])
    assert sum(r["self_cpu_ms"] for r in rows.values()) == pytest.approx(rows["execute"]["cpu_ms"])
    assert 0 < rows["execute"]["cpu_ms"] <= rows["execute"]["ms"] + 0.1
    assert "execute/write/publish" in (tmp_path / "logs" / "worker_profile_t.txt").read_text()


def test_worker_profile_times_the_mapped_seal_and_publish(tmp_path):
    """The GPU path's background work on CPU tensors: a job whose copies went into the arena's regions (the
    mapped copier, every tensor hashed by the table's kernel, interpreted here) sealed, its metadata written and
    the point published under the profile."""
    ops, registry = _cpu_registry(2)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum="mfh64", layout="arena").build(
        retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=1), registry, store)
    profiler = WorkerProfiler([5], str(tmp_path / "logs"), "m")
    try:
        engine.mapped = MappedCopier(store, None, on_device=lambda t: True)
        profiler.attach(engine)
        slot = engine._free.get()
        items = [engine._entry(slot, op, Level.FULL) for op in ops]
        job = _Job(record=SnapshotRecord(iteration=5, bytes=sum(e.nbytes for e in items), num_full=len(ops),
                                         num_compute=0), slot=slot, items=items, meta={"iteration": 5},
                   meta_tensors={}, mapped=engine.mapped.issue(5, slot, items, frozenset()))
        engine._worker.submit(job)
        engine.flush()
    finally:
        engine.mapped = None
        engine.close()
    assert job.record.published and store.verify([5]).problems == ()
    for op in ops:
        loaded = store.load(5, op, Level.FULL)
        assert all(torch.equal(loaded[n], t) for n, t in registry[op].tensors(Level.FULL).items())
    rows = {r["path"]: r for r in json.loads((tmp_path / "logs" / "worker_breakdown_m.json").read_text())
            ["breakdown_per_snapshot"]}
    assert rows["execute/write/mapped.seal/entry.seal"]["calls"] == len(ops)
    assert {"execute/write/mapped.seal/entry.seal/sealed_head/header_lane_sums",  # the header's template
            "execute/write/mapped.seal/entry.seal/sealed_head/header_patch", "execute/write/put_meta/write_entry",
            "execute/write/publish/build_manifest"} <= set(rows)


def test_gil_probe_sees_a_thread_that_keeps_the_gil_in_the_interval_where_it_did():
    """A Python loop that never releases the GIL keeps it for the switch interval (50 ms here) while the probe
    waits to wake up: the probe's lags in that interval reach it; the samples fall into the intervals they were
    taken in."""
    probe = GilProbe()
    interval = sys.getswitchinterval()
    probe.start()
    starts = [time.perf_counter()]
    try:
        time.sleep(0.05)
        starts.append(time.perf_counter())
        sys.setswitchinterval(0.05)
        end = time.perf_counter() + 0.2
        spins = 0
        while time.perf_counter() < end:  # pure Python: holds the GIL until the interpreter forces a switch
            spins += 1
        starts.append(time.perf_counter())
    finally:
        sys.setswitchinterval(interval)
        probe.stop()
    lags = probe.lags_by_interval(starts)
    assert len(lags) == 2 and lags[0] and lags[1]
    assert max(lags[1]) >= 30_000, lags[1]  # microseconds
    assert sum(map(len, lags)) == sum(starts[0] <= t < starts[-1] for t in probe.wake)
    assert 0 < probe.cpu_s < probe.wall_s


def test_lag_stats_are_per_kind_of_block_past_block_boundaries():
    # blocks of 2: 2, 3 paused (3 counts), 4, 5 active (5 counts), 6, 7 paused (7 counts)
    lags = {2: [9000], 3: [100, 300, 5000], 4: [9000], 5: [50, 60, 70, 80], 7: [100, 100]}
    stats = lag_stats(lags, 2)
    assert set(stats) == {"active", "paused"}
    assert stats["active"] == pytest.approx({"iterations": 1, "samples_per_iter": 4, "p50_ms": 0.07, "p99_ms": 0.08,
                                             "max_ms": 0.08, "total_ms_per_iter": 0.26, "over_0.2ms_ms_per_iter": 0})
    assert stats["paused"]["iterations"] == 2 and stats["paused"]["max_ms"] == 5.0
    assert stats["paused"]["total_ms_per_iter"] == pytest.approx(5.6 / 2)
    assert stats["paused"]["over_0.2ms_ms_per_iter"] == pytest.approx(5.3 / 2)
    assert set(lag_stats(lags, 0)) == {"all"}


def test_garbage_collections_are_timed_by_iteration_and_kind_of_block():
    times = GcTimes().install()
    try:
        times.iteration = 5
        junk = [[i] for i in range(1000)]
        junk.append(junk)  # a cycle: only the collector frees it
        del junk
        gc.collect()  # a full collection, in iteration 5
        times.iteration = 6
        gc.collect(0)
    finally:
        times.remove()
    assert times.full == {5: 1} and set(times.seconds) == {5, 6} and all(v > 0 for v in times.seconds.values())
    assert times.totals([5, 6, 7]) == (pytest.approx(times.seconds[5] + times.seconds[6]), 1)
    # blocks of 2: 5 active (counts), 6 paused (a block's first: neither), 7 paused (counts)
    stats = gc_stats({5: 0.004, 6: 0.5, 7: 0.001}, {5: 1}, [4, 5, 6, 7], 2)
    assert stats == {"active": {"iterations": 1, "gc_ms_per_iter": pytest.approx(4.0), "full_per_100_iters": 100.0},
                     "paused": {"iterations": 1, "gc_ms_per_iter": pytest.approx(1.0), "full_per_100_iters": 0.0}}
    assert set(gc_stats({}, {}, [1, 2], 0)) == {"all"}


def test_traced_blocks_are_inside_the_last_blocks_of_each_kind_past_their_first_iteration():
    # blocks of 4 from 0: active 0-3, paused 4-7, active 8-11, paused 12-15, active 16-19 (iters 20: 19 has no successor)
    assert trace_iterations(iters=20, warmup=4, block=4, n=2) == {"active": [17, 18], "paused": [13, 14]}
    assert trace_iterations(iters=20, warmup=4, block=4, n=3) == {"active": [9, 10, 11], "paused": [13, 14, 15]}
    assert trace_iterations(iters=20, warmup=4, block=4, n=0) == {}
    with pytest.raises(ValueError, match="needs --interleave > 4"):
        trace_iterations(iters=20, warmup=4, block=4, n=4)
    with pytest.raises(ValueError, match="needs a paused block"):
        trace_iterations(iters=20, warmup=14, block=4, n=2)


def test_a_trace_is_summed_per_stream_and_thread_per_iteration():
    events = [  # two iterations: stream 7 computes, stream 20 copies and hashes; thread 1 trains, thread 2 snapshots
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 4000, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 6000, "dur": 4000, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "hash", "ts": 1000, "dur": 1000, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 2000, "dur": 2000,
         "args": {"stream": 20}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 1000, "dur": 1000, "tid": 1},  # nested: counted once
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 5000, "dur": 1000, "tid": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 5000, "dur": 800, "tid": 2},
        {"ph": "i", "cat": "cpu_instant_event", "name": "marker", "ts": 50, "tid": 1},  # not a span: left out
    ]
    s = summarize(events, 2, training_tid=1, thread_names={2: "moe-ft-snapshot"})
    assert s["kernel_ms"] == {"stream 20": 0.5, "stream 7": 4.0} and s["kernels"] == {"stream 20": 0.5, "stream 7": 1.0}
    assert s["compute_stream"] == {"stream": "stream 7", "busy_ms": 4.0, "idle_ms": 1.0}
    assert s["memcpy_ms"] == {"stream 20 Memcpy DtoH (Device -> Pinned)": 1.0}
    assert s["cpu_ms"] == {"training": 1.5, "moe-ft-snapshot (2)": 0.5} and s["span_ms"] == 5.0
    assert s["runtime_ms"] == {"moe-ft-snapshot (2)": 0.4, "training": 0.005}
    assert s["runtime_top"]["moe-ft-snapshot (2)"] == {"cudaEventSynchronize": 0.4}
    assert summarize(events, 2)["cpu_ms"] == {"tid 1": 1.5, "tid 2": 0.5}


def test_the_tracer_records_the_training_thread_and_a_thread_that_snapshots(tmp_path):
    """A real profiler on CPU over the ranges given: the training thread's ops, and those of a thread that was
    started (and ran torch ops) before the trace began, where the installed torch records every thread. The
    other thread runs its op on request (it snapshots during the active iterations only), and the training
    thread waits for each, so the traced iterations hold its ops whatever the machine's load."""
    x = torch.randn(128, 128)
    requests: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def snapshots() -> None:
        (x @ x).sum()
        while requests.get():
            x.clone()
            done.put(True)

    other = threading.Thread(target=snapshots, name="snapshots")
    other.start()
    tracer = BlockTracer({"active": [3, 4], "paused": [7]}, str(tmp_path), "t")
    try:
        for iteration in range(9):
            tracer.on_step_begin(iteration)
            for _ in range(5):
                (x @ x).relu()
                if iteration < 5:
                    requests.put(True)
                    assert done.get(timeout=30)
                time.sleep(0.002)
    finally:
        requests.put(False)
        other.join()
    summary = json.loads((tmp_path / "trace_summary_t.json").read_text())
    assert summary["active"]["traced"] == [3, 4] and summary["paused"]["traced"] == [7]
    assert all(s["cpu_ms"]["training"] > 0 for s in summary.values())
    if summary["active"]["all_threads"]:
        assert summary["active"]["cpu_ms"][f"snapshots ({other.native_id})"] > 0
        assert f"snapshots ({other.native_id})" not in summary["paused"]["cpu_ms"]
    assert (tmp_path / "trace_t_active.json.gz").exists() and not (tmp_path / "trace_t_active.json").exists()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_tiny_launch_profiles_the_worker_and_probes_the_gil(tmp_path, corpus):
    """One sparse launch (``--skip-none --skip-default``: only the kernel-copy variant, which a CPU registry
    copies as the default does) with the background thread's profile, the GIL probe and another switch interval
    in the worker."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "tools.bench.gpu_overhead", "--tiny", "--iters", "24", "--warmup", "4",
           "--windows", "2", "--interleave", "4", "--profile-worker", "1", "--gil-probe", "--switch-interval", "0.001",
           "--trace-blocks", "2", "--skip-none", "--skip-default", "--kernel-copy", "16", "--data-path", corpus,
           "--store-root", str(tmp_path), "--log-dir", str(logs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert set(result["runs"]) == {"sparse(W=2,kernel copy on 16 programs)"} and "overhead_ratio" not in result
    sparse = result["runs"]["sparse(W=2,kernel copy on 16 programs)"][0]
    assert sparse["switch_interval_s"] == 0.001 and 0 < sparse["gil_probe_cpu_share"] < 1
    # blocks of 4 in 24 iterations, the last ones active 16-19 and paused 20-23: traced 17, 18 and 21, 22; the
    # worker's profile: 19 (the last iteration with a snapshot); the timings stop at 17
    assert sparse["measured_end"] == 17 and sparse["profiled"]["worker"] == [19]
    assert sorted(sparse["profiled"]["traced"]) == [17, 18, 21, 22]
    trace = sparse["trace"]
    assert set(trace) == {"active", "paused"} and trace["active"]["traced"] == [17, 18]
    assert all(t["cpu_ms"]["training"] > 0 and t["wall_ms"] > 0 for t in trace.values())
    assert (logs / "trace_sparse2k16_0_active.json.gz").exists() and (logs / "trace_sparse2k16_0_paused.json.gz").exists()
    gil = sparse["interleaved"]["gil_probe"]
    assert set(gil) == {"active", "paused"} and all(g["samples_per_iter"] > 0 for g in gil.values())
    assert set(sparse["interleaved"]["gc"]) == {"active", "paused"}  # collections timed in every launch
    breakdown = json.loads((logs / "worker_breakdown_sparse2k16_0.json").read_text())
    assert breakdown["snapshots"]["19"]["published"]
    paths = {row["path"] for row in breakdown["breakdown_per_snapshot"]}
    assert {"execute", "execute/write/put/point.put", "execute/write/publish"} <= paths


@pytest.mark.parametrize("step", ["copy", "hash", "publish"])
def test_snapshots_cut_after_a_step_publish_nothing_and_skip_what_follows(tmp_path, step):
    """``gpu_overhead.py --steps`` (tools/bench/snapshot_steps.py) on the GPU path's copier with CPU tensors
    (the kernel interpreted): ``copy`` launches no hash, ``hash`` computes the tensors' sums, neither publishes
    nor leaves a staged point; ``publish`` is the whole path."""
    from moe_ft.store.entry_hash import lane_sums_of
    from tools.bench.snapshot_steps import limit_to_step

    ops, registry = _cpu_registry(3)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum="mfh64", layout="arena").build(
        retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(num_slots=1), registry, store)
    try:
        engine.mapped = MappedCopier(store, None, on_device=lambda t: True)
        limit_to_step(engine, step)
        slot = engine._free.get()
        engine.mapped._rows[slot] = torch.full((64, 2), -7, dtype=torch.int64)  # what no hash leaves
        items = [engine._entry(slot, op, Level.FULL) for op in ops]
        job = _Job(record=SnapshotRecord(iteration=4, bytes=sum(e.nbytes for e in items), num_full=len(ops),
                                         num_compute=0), slot=slot, items=items, meta={"iteration": 4},
                   meta_tensors={}, mapped=engine.mapped.issue(4, slot, items, frozenset()))
        rows = job.mapped.rows.tolist()
        engine._worker.submit(job)
        engine.flush()
    finally:
        engine.mapped = None
        engine.close()
    srcs = [(t, first) for e, (reserved, _) in zip(items, job.mapped.reserved)
            for t, first in zip(e.srcs, reserved.layout.first_words)]
    if step == "copy":
        assert rows == [[-7, -7]] * len(srcs)
    else:
        assert rows == [lane_sums_of(t, first) for t, first in srcs]
    assert store.staging() == []
    assert store.points() == ([4] if step == "publish" else [])
    assert (job.record.skipped == "") == (step == "publish")


def test_a_step_needs_the_copy_into_the_store(tmp_path):
    from tools.bench.snapshot_steps import limit_to_step

    ops, registry = _cpu_registry(4)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(), registry, store)
    try:
        with pytest.raises(ValueError, match="does not use: the registry is not on CUDA"):
            limit_to_step(engine, "copy")
        with pytest.raises(ValueError, match="unknown snapshot step"):
            limit_to_step(engine, "seal")
        engine.mapped = MappedCopier(store, None, copy_by="kernel")
        with pytest.raises(ValueError, match="the hash kernel is the copy"):
            limit_to_step(engine, "copy")
        engine.mapped = None
    finally:
        engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("copy_by", ["dma", "kernel"])
def test_the_cpu_bench_of_the_mapped_seal_measures_the_snapshots_after_three_windows(capsys, copy_by):
    """``tools/bench/mapped_seal_cpu.py``: the background thread's CPU per snapshot on the GPU path's work with CPU
    tensors, after three windows; the retention keeps two windows and the one in flight. With the kernel's copy
    (``--copy-by kernel``) the points it publishes verify (the kernel wrote every byte)."""
    from tools.bench import mapped_seal_cpu

    assert mapped_seal_cpu.main(["--snapshots", "10", "--window", "2", "--layers", "1", "--copy-by", copy_by]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["copy_by"] == copy_by and out["verify_problems"] == []
    assert out["snapshots_measured"] == 4 and out["entries_per_snapshot"] > 5
    assert 0 < out["thread_cpu_ms_median"] <= out["thread_cpu_ms_per_snapshot"] * 4 and out["points_kept"] >= 4
    assert 0 < out["issue_cpu_ms_median"] <= out["issue_cpu_ms_per_snapshot"] * 4
    with pytest.raises(SystemExit):
        mapped_seal_cpu.main(["--snapshots", "6", "--window", "2"])
    assert "--snapshots must exceed three windows (6)" in capsys.readouterr().err
