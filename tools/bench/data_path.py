"""The snapshot data path alone: engine thread CPU per point for slot-buffer copy vs direct write into
each store layout (new entry files, recycled entry files, the arena), side by side in one process.

    python tools/bench/data_path.py [--points 30] [--json]      # ~20 s on 2 cores

No model: a registry of 16 expert-sized operators (weights + two Adam moments, fp32, 2 MiB each tensor:
6.3 MB FULL, 2.1 MB COMPUTE per operator) on the CPU, one :class:`SnapshotEngine` and store per variant on
``/dev/shm``, submitted round robin (point ``t`` of every variant before point ``t+1`` of any), so the
variants share the machine's noise. Two plan shapes:

* ``sparse``: a window of 5, one operator in five FULL per point, the others COMPUTE (MoEvement), retention
  by windows (two kept): 50 MB per point;
* ``dense``: every operator FULL at every point, the newest two points kept: 101 MB per point.

Reported per (shape, variant): the median of the background thread's CPU per point (``thread_cpu_ms``;
copy, checksum, writes, publish, GC: everything the training process pays for a snapshot on the CPU path),
the median time the next optimizer step would wait for (``copy_ms``: the slot copy, or the direct writes),
the entries written over pooled files, and ``ratio`` = thread CPU / that of the old path (slot copy into new
files). The first 10 points of each variant are warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {  # name: (direct_write, layout, recycle)
    "slot copy, new files": (False, "files", False),
    "slot copy, recycled files": (False, "files", True),
    "slot copy, arena": (False, "arena", False),
    "direct, new files": (True, "files", False),
    "direct, recycled files": (True, "files", True),
    "direct, arena": (True, "arena", False),
}
WINDOW = 5
WARMUP = 10


def registry(num_ops: int = 16, numel: int = 512 * 1024):
    import torch

    from moe_ft.state.operators import OperatorId
    from moe_ft.state.registry import OperatorRegistry, OperatorState

    gen = torch.Generator().manual_seed(0)
    states = {}
    for i in range(num_ops):
        op = OperatorId.expert_op(i // 4, i % 4)
        states[op] = OperatorState(op=op, compute={"weight": torch.randn(numel, generator=gen)}, master={},
                                   optim={"exp_avg": torch.randn(numel, generator=gen),
                                          "exp_avg_sq": torch.rand(numel, generator=gen)})
    return OperatorRegistry(states, pp_rank=0, ep_rank=0)


def plan(shape: str, ops: list, t: int) -> dict:
    from moe_ft.state.operators import Level

    if shape == "dense":
        return {op: Level.FULL for op in ops}
    return {op: Level.FULL if (i + t) % WINDOW == 0 else Level.COMPUTE for i, op in enumerate(ops)}


def run(shape: str, points: int, root: str) -> dict:
    from moe_ft.snapshot import EngineConfig, SnapshotEngine
    from moe_ft.store import DenseRule, KeepTwoRecoverable, StoreConfig
    from moe_ft.store.rules import SparseWindowRule

    reg = registry()
    ops = list(reg)
    engines = {}
    for i, (name, (direct, layout, recycle)) in enumerate(VARIANTS.items()):
        rule = DenseRule(operators=frozenset(ops)) if shape == "dense" else SparseWindowRule.aligned(ops, WINDOW)
        store = StoreConfig(root=root, job_id=f"{shape}{i}", rank=0, recycle=recycle, layout=layout).build(
            retention=KeepTwoRecoverable(rule=rule))
        engines[name] = SnapshotEngine(EngineConfig(direct_write=direct), reg, store)
    try:
        for t in range(points):
            for engine in engines.values():
                engine.submit(t, plan(shape, ops, t), {"t": t}, {})
                engine.wait_copied()
                engine.flush()
    finally:
        for engine in engines.values():
            engine.close()
    result = {}
    for name, engine in engines.items():
        recs = engine.records[WARMUP:]
        pool = getattr(engine.store.backend, "pool", None)
        result[name] = {"mb_per_point": round(recs[0].bytes / 1e6, 1),
                        "thread_cpu_ms": round(1e3 * statistics.median(r.thread_cpu_s for r in recs), 2),
                        "copy_ms": round(1e3 * statistics.median(r.copy_s for r in recs), 2),
                        "entries_reused": pool.reused if pool is not None else 0}
    base = result["slot copy, new files"]["thread_cpu_ms"]
    for r in result.values():
        r["ratio"] = round(r["thread_cpu_ms"] / base, 3)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", type=int, default=30, help="points per variant (the first 10 are warm-up)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args()
    if a.points <= WARMUP:
        p.error(f"--points must be > {WARMUP} (the warm-up)")
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(1)
    report = {}
    with tempfile.TemporaryDirectory(prefix="moe_ft_data_path_",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        for shape in ("sparse", "dense"):
            report[shape] = run(shape, a.points, root)
    report["_setup"] = {"points": a.points, "warmup": WARMUP, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"{'shape':7s} {'variant':27s} {'MB/point':>9s} {'thread CPU ms':>14s} {'ratio':>6s} {'copy ms':>8s} "
          f"{'reused':>7s}")
    for shape in ("sparse", "dense"):
        for name, r in report[shape].items():
            print(f"{shape:7s} {name:27s} {r['mb_per_point']:9.1f} {r['thread_cpu_ms']:14.2f} {r['ratio']:6.3f} "
                  f"{r['copy_ms']:8.2f} {r['entries_reused']:7d}")
    print(json.dumps(report["_setup"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
