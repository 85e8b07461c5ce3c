"""CPU time of the GPU snapshot path's background work per snapshot (sealing the entries copied into the
arena's regions, the metadata entry, publishing, garbage collection), measured on CPU tensors: the Python that
holds the GIL beside a launch-bound training thread on a GPU (docs/benchmarks.md, "Sixth round").

    python -m tools.bench.mapped_seal_cpu [--snapshots 48] [--window 8] [--layers 4] [--copy-by {dma,kernel}]
                                          [--publish-by {trainer,agent}] [--root OTHER_CHECKOUT]

A registry shaped like ``tools/bench/gpu_overhead.py``'s model (embedding, output, 4 layers of a dense and a gate
operator and 8 experts; small tensors: the cost is per entry and per tensor, not per byte), sparse-like plans of
window ``--window`` (one slice FULL, the later ones COMPUTE: ~23 entries per snapshot), the store's retention
(two recoverable windows). The copier's device hash runs as the Triton kernel interpreted (``TRITON_INTERPRET=1``)
at issue, outside the measurement; the background thread's CPU (``time.thread_time``) is measured on the
snapshots after the first three windows, and so is the training thread's share of the issue
(``issue_cpu_ms_per_snapshot``: ``MappedCopier.issue`` -- reserving the regions, their views, the copies of these
small CPU tensors, the plan -- less the hash it queues, which on a GPU is a kernel launch). ``--copy-by kernel``:
the copier's kernel copies the tensors it hashes (``--ft-snapshot-copy-by kernel``): the issue then queues no
copies of its own for them and computes their destinations instead. ``--publish-by agent``: the node agent seals,
publishes and collects (``--ft-publish-by agent``, a real agent process); the thread then only hands each point
over and waits for the answer (``agent_cpu_ms_per_snapshot``: the agent's CPU, from ``/proc``). ``--root``: import
``moe_ft`` from another checkout (an older commit, for a before/after comparison). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshots", type=int, default=48)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the registry (8 experts each)")
    p.add_argument("--copy-by", choices=["dma", "kernel"], default="dma",
                   help="who copies the tensors the kernel hashes (--ft-snapshot-copy-by)")
    p.add_argument("--publish-by", choices=["trainer", "agent"], default="trainer",
                   help="who seals and publishes each point (--ft-publish-by)")
    p.add_argument("--root", default=None, help="a checkout whose moe_ft to measure (default: this one)")
    a = p.parse_args(argv)
    if a.window < 1 or a.snapshots <= 3 * a.window:
        p.error(f"--snapshots must exceed three windows ({3 * a.window})")
    sys.path.insert(0, os.path.abspath(a.root or os.path.join(os.path.dirname(__file__), "..", "..")))
    import torch

    from moe_ft.snapshot import EngineConfig, SnapshotEngine, SnapshotRecord
    from moe_ft.snapshot.engine import _Job
    from moe_ft.snapshot.mapped import MappedCopier
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.state.registry import OperatorRegistry, OperatorState
    from moe_ft.store import KeepTwoRecoverable, SparseWindowRule, StoreConfig

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ops = [OperatorId.embedding(), OperatorId.output()]
    for layer in range(a.layers):
        ops += [OperatorId.dense(layer), OperatorId.gate(layer)] + [OperatorId.expert_op(layer, e) for e in range(8)]
    states = {}
    for op in ops:
        n = 2 if op.is_expert else 6
        states[op] = OperatorState(op=op, compute={f"p{i}": torch.randn(16, 8, generator=gen) for i in range(n)},
                                   optim={f"{k}.p{i}": torch.randn(16, 8, generator=gen) for i in range(n)
                                          for k in ("main", "exp_avg", "exp_avg_sq")})
    registry = OperatorRegistry(states, pp_rank=0, ep_rank=0)
    groups = [ops[i::a.window] for i in range(a.window)]

    def plan(it: int) -> dict:
        k = it % a.window
        return {op: Level.FULL if g == k else Level.COMPUTE for g, members in enumerate(groups) if g >= k
                for op in members}

    cpu: list[float] = []
    issue_cpu: list[float] = []
    entries: list[int] = []
    with tempfile.TemporaryDirectory(prefix="mapped_seal_cpu_") as root:
        store = StoreConfig(root=root, job_id="j", rank=0, checksum="mfh64", layout="arena").build(
            retention=KeepTwoRecoverable(rule=SparseWindowRule.aligned(ops, a.window)))
        publisher = None
        if a.publish_by == "agent":
            from moe_ft.agent.publish import AgentPublisher

            publisher = AgentPublisher(store, rank=0, agent_dir=os.path.join(root, "j", "agent"))
        engine = SnapshotEngine(EngineConfig(num_slots=2), registry, store)
        kw = {"copy_by": a.copy_by} if a.copy_by != "dma" else {}  # an older --root has no copy_by
        engine.mapped = MappedCopier(store, None, on_device=lambda t: True, **kw)
        handle = engine._worker._handle
        hashing = [0.0]
        device_hash = engine.mapped._hash

        def timed_hash(*args) -> None:  # interpreted here; on a GPU a launch: left out of the issue's time
            start = time.thread_time()
            try:
                device_hash(*args)
            finally:
                hashing[0] += time.thread_time() - start

        engine.mapped._hash = timed_hash  # type: ignore[method-assign,assignment]

        def timed(job) -> None:
            start = time.thread_time()
            try:
                handle(job)
            finally:
                if job.record.iteration >= 3 * a.window:
                    cpu.append(time.thread_time() - start)
                    entries.append(len(job.items))

        engine._worker._handle = timed
        meta = {"rng": torch.get_rng_state(), "popularity": torch.zeros(4, 8)}
        agent_cpu: list[float] = []
        try:
            for it in range(a.snapshots):
                slot = engine._free.get()
                items = [engine._entry(slot, op, level) for op, level in sorted(plan(it).items())]
                hashing[0], start = 0.0, time.thread_time()
                mapped = engine.mapped.issue(it, slot, items, frozenset())
                if it >= 3 * a.window:
                    issue_cpu.append(time.thread_time() - start - hashing[0])
                job = _Job(record=SnapshotRecord(iteration=it, bytes=sum(e.nbytes for e in items), num_full=0,
                                                 num_compute=0),
                           slot=slot, items=items, meta={"iteration": it}, meta_tensors=dict(meta), mapped=mapped)
                agent0 = _process_cpu(publisher.client.pid) if publisher is not None else 0.0
                engine._worker.submit(job)
                engine.flush()
                if publisher is not None and it >= 3 * a.window:
                    agent_cpu.append(_process_cpu(publisher.client.pid) - agent0)
        finally:
            engine.mapped = None
            engine.close()
            if publisher is not None:
                publisher.close()
        published = store.points()
        problems = store.verify(published).problems  # every byte the copier wrote (by the kernel, too) checks out
    print(json.dumps({"root": a.root or "this checkout", "copy_by": a.copy_by, "publish_by": a.publish_by,
                      "snapshots_measured": len(cpu),
                      "entries_per_snapshot": statistics.mean(entries),
                      "thread_cpu_ms_per_snapshot": 1e3 * statistics.mean(cpu),
                      "thread_cpu_ms_median": 1e3 * statistics.median(cpu),
                      "issue_cpu_ms_per_snapshot": 1e3 * statistics.mean(issue_cpu),
                      "issue_cpu_ms_median": 1e3 * statistics.median(issue_cpu), "points_kept": len(published),
                      **({"agent_cpu_ms_per_snapshot": 1e3 * statistics.mean(agent_cpu)} if agent_cpu else {}),
                      "verify_problems": [str(p) for p in problems]}))
    return 0


def _process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
