"""``tools/bench/gpu_overhead.py --interleave K --profile-submit N``: the in-launch comparison of iterations with
and without snapshots, and the profile of the engine's ``submit``, on the drill's tiny model (one CPU rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.snapshot.mapped import MappedCopier
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorRegistry, OperatorState
from moe_ft.store import KeepAll, StoreConfig, arena, entry_hash_triton
from moe_ft.store import store as store_module
from tools.bench.interleave import interleaved_stats, iteration_kind, profile_iterations, snapshots_paused
from tools.bench.submit_profile import _Breakdown, _targets, _wrapped

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
    assert stats["ratio"] == pytest.approx(1.1)
    assert stats["blocks"] == {"active": 4, "paused": 3}  # 0 (2, 3), 8, 16, 24 (25) / 4, 12, 20
    assert stats["iterations"] == {"active": 2 + 3 + 3 + 1, "paused": 9}
    assert stats["snapshots"]["paused"] == 0 and stats["snapshots"]["active"] == 12
    assert stats["hooks_ms"] == pytest.approx({"active": 2.0, "paused": 1.0})
    assert [b[1] for b in stats["block_medians"]] == ["active", "paused", "active", "paused", "active", "paused",
                                                      "active"]
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
    classes = [(store_module.PendingPoint, "reserve"), (store_module.PendingPoint, "layout"),
               (store_module.ReservedEntry, "byte_views"), (arena._ArenaWriter, "map_blob"),
               (entry_hash_triton.TensorTable, "launch")]
    before = [vars(cls)[attr] for cls, attr in classes] + [torch._foreach_copy_, entry_hash_triton.device_lane_sums]
    try:
        engine.mapped = MappedCopier(store, None, on_device=lambda t: True)  # what a CUDA registry gets
        items = [engine._entry(0, op, Level.FULL) for op in ops]
        breakdown = _Breakdown()
        breakdown.owner = threading.get_ident()
        with _wrapped(_targets(engine), breakdown):
            engine.mapped.issue(0, 0, items, frozenset()).point.abort()
        calls = dict(breakdown.calls)
        assert calls["mapped.issue"] == 1 and calls["mapped.issue/reserve"] == len(ops)
        assert calls["mapped.issue/byte_views"] == calls["mapped.issue/prep"] == len(ops)
        assert {"mapped.issue/store.begin/list_points", "mapped.issue/store.begin/begin_point",
                "mapped.issue/reserve/layout", "mapped.issue/reserve/map_blob", "mapped.issue/pinned.refresh",
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
    assert sparse["measured_end"] == 18 and sparse["profiled"] == {"breakdown": [18], "profiler": [19]}
    assert none["interleaved"]["control"] and none["measured_end"] is None
    assert set(result["interleaved_ratio"]) == {"none", "sparse(W=2)"} and "sparse(W=2)" in result["overhead_ratio"]

    table = (logs / "submit_profile_sparse2_0.txt").read_text()
    assert "Self CPU" in table and "submit of iteration 19" in table
    breakdown = json.loads((logs / "submit_breakdown_sparse2_0.json").read_text())
    paths = {row["path"]: row for row in breakdown["breakdown_per_iteration"]}
    assert {"submit", "submit/free_slot", "submit/entry", "submit/stage_meta", "submit/worker.submit"} <= set(paths)
    # self times add up to the inclusive time of the whole submit
    assert sum(row["self_ms"] for row in paths.values()) == pytest.approx(paths["submit"]["ms"])
    assert paths["submit"]["calls"] == 1 and breakdown["top_ops_per_iteration"]
    assert set(breakdown["issue_ms"]) == {"breakdown", "profiler"}
