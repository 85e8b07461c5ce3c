"""Snapshot engine on CUDA: device-to-host bandwidth and stall, side by side in one run.

    python -m tools.bench.gpu_snapshot [--layers 2 --hidden 1024 --ffn 4096 --experts 8 --vocab 32768]

A synthetic operator registry shaped like one rank of an MoE GPT in bf16 mixed precision (per parameter:
bf16 compute weight, fp32 master, fp32 Adam ``exp_avg``/``exp_avg_sq``; a host ``step`` counter per
operator, as torch's Adam keeps it) lives on the GPU. Prints one JSON object:

* ``pinned_copy_gbps``: one ``copy_(non_blocking=True)`` of all FULL bytes as a single device tensor
  into pinned host memory (the reference the goal is stated against: D2H >= 80 % of it);
* ``pinned_per_tensor_gbps``: the registry's own tensors, one ``copy_`` each into pinned buffers;
* ``engine_gbps``: the engine's FULL snapshot: bytes / device time of its side-stream copies (its events),
  median over ``--iters``; ``engine_vs_pinned`` = ``engine_gbps / pinned_copy_gbps``;
* ``stall``: a training stand-in per iteration -- ``submit(t, plan)``, ``--compute-ms`` of bf16 matmuls on
  the compute stream (forward/backward), ``wait_copied()``, an optimizer stand-in (in-place add on every
  live tensor), then a host sync (the loop's ``float(loss)``). For a sparse-window plan (``--window``
  slices: FULL for slice ``t mod W``, COMPUTE for the later slices, NONE for the earlier ones) and for FULL
  every iteration: median host wait in ``wait_copied`` (goal 0), median and max device stall (compute
  stream waiting for the copy), the wait for a free buffer slot (store slower than training), the store's
  write time, and the iteration-time ratio against the same loop without snapshots (run before and after).
  ``store_write_gbps_by_threads``: the store's write rate with 1 and 8 writer threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorRegistry, OperatorState


def _param_state(name: str, shape: tuple, device, gen) -> tuple[dict, dict, dict]:
    master = torch.randn(shape, generator=gen, device=device)
    compute = {name: master.to(torch.bfloat16)}
    optim = {f"exp_avg.{name}": torch.randn(shape, generator=gen, device=device),
             f"exp_avg_sq.{name}": torch.rand(shape, generator=gen, device=device)}
    return compute, {f"master.{name}": master}, optim


def synthetic_registry(*, layers: int, hidden: int, ffn: int, experts: int, vocab: int,
                       device="cuda", seed: int = 0) -> OperatorRegistry:
    """One rank's operators (dense, gate and experts per layer, embedding, output) with random state."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes: dict[OperatorId, dict[str, tuple]] = {
        OperatorId.embedding(): {"embedding.word_embeddings.weight": (vocab, hidden)},
        OperatorId.output(): {"output_layer.weight": (vocab, hidden)},
    }
    for layer in range(layers):
        p = f"decoder.layers.{layer}"
        shapes[OperatorId.dense(layer)] = {f"{p}.self_attention.linear_qkv.weight": (3 * hidden, hidden),
                                           f"{p}.self_attention.linear_proj.weight": (hidden, hidden),
                                           f"{p}.input_layernorm.weight": (hidden,),
                                           f"{p}.pre_mlp_layernorm.weight": (hidden,)}
        shapes[OperatorId.gate(layer)] = {f"{p}.mlp.router.weight": (experts, hidden)}
        for e in range(experts):
            q = f"{p}.mlp.experts.local_experts.{e}"
            shapes[OperatorId.expert_op(layer, e)] = {f"{q}.linear_fc1.weight": (ffn, hidden),
                                                     f"{q}.linear_fc2.weight": (hidden, ffn)}
    ops = {}
    for op, params in shapes.items():
        st = OperatorState(op=op)
        for name, shape in params.items():
            compute, master, optim = _param_state(name, shape, device, gen)
            st.compute.update(compute)
            st.master.update(master)
            st.optim.update(optim)
        st.optim["step"] = torch.tensor(1.0)  # host-resident, like torch Adam's step
        ops[op] = st
    return OperatorRegistry(ops, pp_rank=0, ep_rank=0)


def sparse_plan(ops: list, iteration: int, window: int) -> dict:
    """MoEvement §3.2 shape: slice ``t mod W`` FULL, later slices COMPUTE, earlier ones NONE."""
    k = iteration % window
    plan = {}
    for i, op in enumerate(ops):
        s = i * window // len(ops)
        plan[op] = Level.FULL if s == k else Level.COMPUTE if s > k else Level.NONE
    return plan


def _event_seconds(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def pinned_bandwidth(registry: OperatorRegistry, repeat: int) -> dict:
    """GB/s of plain pinned copies of the registry's FULL bytes: one big tensor, and tensor by tensor."""
    live = [t for op in registry for t in registry[op].tensors(Level.FULL).values() if t.is_cuda]
    nbytes = sum(t.nbytes for t in live)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    one = _event_seconds(lambda: dst.copy_(src, non_blocking=True), repeat)
    dsts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in live]

    def per_tensor():
        for d, s in zip(dsts, live):
            d.copy_(s, non_blocking=True)

    each = _event_seconds(per_tensor, repeat)
    return {"bytes": nbytes, "pinned_copy_gbps": nbytes / statistics.median(one) / 1e9,
            "pinned_per_tensor_gbps": nbytes / statistics.median(each) / 1e9}


def _keep_newest():
    """Retention for the benchmark: the two newest points (the store must not fill the tmpfs)."""
    from moe_ft.store import RetentionPolicy

    class KeepNewest(RetentionPolicy):
        def keep(self, catalog):
            return set(sorted(catalog.iterations)[-2:])

    return KeepNewest()


def _engine(registry, root: str, job: str, slots: int, write_threads: int | None = None, mapped: bool = False):
    """``mapped``: copies straight into the store's regions, hashed on the device (moe_ft/snapshot/mapped.py);
    else the staged path (pinned slot buffers, host checksum and store write)."""
    from moe_ft.snapshot import EngineConfig, SnapshotEngine
    from moe_ft.store import StoreConfig

    full = sum(t.nbytes for op in registry for t in registry[op].tensors(Level.FULL).values())
    store = StoreConfig(root=root, job_id=job, rank=0, checksum="mfh64" if mapped else "xxh3_64",
                        initial_bytes=3 * full if mapped else 0).build(retention=_keep_newest())
    engine = SnapshotEngine(EngineConfig(num_slots=slots, write_threads=write_threads,
                                         direct_write=None if mapped else False), registry, store)
    assert (engine.mapped is not None) == mapped, engine.mapped_off
    return engine


def engine_bandwidth(registry: OperatorRegistry, root: str, iters: int, write_threads: int | None = None,
                     mapped: bool = False) -> dict:
    """The engine's FULL snapshot, one at a time (flushed in between: the store write is not in the copy
    time; it is reported as ``store_write_gbps``)."""
    start = time.perf_counter()
    # staged: allocates and page-locks 2 arenas of all FULL bytes; mapped: maps and page-locks the store's
    engine = _engine(registry, root, "bwm" if mapped else "bw", 2, write_threads, mapped)
    build_s = time.perf_counter() - start
    plan = {op: Level.FULL for op in registry}
    try:
        for it in range(iters + 1):
            engine.submit(it, plan, {"iteration": it}, {})
            engine.wait_copied()
            engine.flush()
        recs = engine.records[1:]  # the first snapshot warms up
        device_bytes = sum(t.nbytes for op in registry for t in registry[op].tensors(Level.FULL).values() if t.is_cuda)
        return {"engine_gbps": device_bytes / statistics.median(r.copy_s for r in recs) / 1e9,
                "engine_issue_ms": 1e3 * statistics.median(r.issue_s for r in recs),
                "store_write_gbps": recs[0].bytes / statistics.median(r.write_s for r in recs) / 1e9,
                "pinned_arena_bytes_per_slot": engine.buffers.arena_bytes, "engine_build_s": round(build_s, 3),
                "thread_cpu_ms": 1e3 * statistics.median(r.thread_cpu_s for r in recs),
                "trainer_payload_bytes_per_byte": max(r.trainer_payload_bytes_per_byte for r in recs)}
    finally:
        engine.close()


def stall_loop(registry: OperatorRegistry, root: str, *, iters: int, compute_ms: float, window: int,
               full: bool, slots: int, mapped: bool = False) -> dict:
    """Training stand-in with and without snapshots (see the module docstring)."""
    ops = list(registry)
    live = [t for op in ops for t in registry[op].tensors(Level.FULL).values() if t.is_cuda]
    host = [t for op in ops for t in registry[op].tensors(Level.FULL).values() if not t.is_cuda]
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    one = statistics.median(_event_seconds(lambda: x @ x, 5))
    n_mm = max(1, round(compute_ms / 1e3 / one))

    def iteration():
        for _ in range(n_mm):
            y = x @ x
        return y

    def run(engine) -> list[float]:
        times = []
        for it in range(iters):
            start = time.perf_counter()
            if engine is not None:
                plan = {op: Level.FULL for op in ops} if full else sparse_plan(ops, it, window)
                engine.submit(it, plan, {"iteration": it}, {"rng": torch.get_rng_state()})
            y = iteration()
            if engine is not None:
                engine.wait_copied()
            torch._foreach_add_(live, 1.0)  # the optimizer step modifies every live tensor in place
            for t in host:
                t.add_(1.0)
            float(y[0, 0])  # the loop's host sync (float(loss))
            times.append(time.perf_counter() - start)
        return times

    warm = max(2, window)
    base = run(None)[warm:]
    engine = _engine(registry, root, ("full" if full else "sparse") + ("_mapped" if mapped else ""), slots,
                     mapped=mapped)
    try:
        with_ft = run(engine)[warm:]
        engine.flush()
        recs = engine.records[warm:]
    finally:
        engine.close()
    base += run(None)[warm:]  # without, with, without: cancels a drift of the clock over the run
    return {"plan": "full" if full else f"sparse(W={window})", "path": "mapped" if mapped else "staged",
            "iterations": len(recs),
            "thread_cpu_ms": 1e3 * statistics.median(r.thread_cpu_s for r in recs),
            "trainer_payload_bytes_per_byte": max(r.trainer_payload_bytes_per_byte for r in recs),
            "compute_ms": round(1e3 * one * n_mm, 2),
            "bytes_per_iter": int(statistics.mean(r.bytes for r in recs)),
            "host_wait_copied_ms": 1e3 * statistics.median(r.stall_s - r.slot_wait_s for r in recs),
            "host_wait_copied_max_ms": 1e3 * max(r.stall_s - r.slot_wait_s for r in recs),
            "slot_wait_median_ms": 1e3 * statistics.median(r.slot_wait_s for r in recs),
            "slot_wait_max_ms": 1e3 * max(r.slot_wait_s for r in recs),
            "device_stall_median_ms": 1e3 * statistics.median(r.device_stall_s for r in recs),
            "device_stall_max_ms": 1e3 * max(r.device_stall_s for r in recs),
            "copy_ms": 1e3 * statistics.median(r.copy_s for r in recs),
            "store_write_ms": 1e3 * statistics.median(r.write_s for r in recs),
            "iter_ms_without": 1e3 * statistics.median(base), "iter_ms_with": 1e3 * statistics.median(with_ft),
            "overhead_ratio": statistics.median(with_ft) / statistics.median(base)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--iters", type=int, default=6, help="engine bandwidth: measured FULL snapshots")
    p.add_argument("--stall-iters", type=int, default=16)
    p.add_argument("--compute-ms", type=float, default=300.0, help="forward/backward stand-in per iteration")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--store-root", default="/dev/shm")
    p.add_argument("--thread-sweep", action="store_true", help="also the staged store write with 1 and 8 threads")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_snapshot needs CUDA (the CPU path is measured by tools/bench/ckpt_overhead.py)")
    registry = synthetic_registry(layers=a.layers, hidden=a.hidden, ffn=a.ffn, experts=a.experts, vocab=a.vocab)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": {k: getattr(a, k) for k in ("layers", "hidden", "ffn", "experts", "vocab")},
           "num_operators": len(registry),
           "num_tensors": sum(len(registry[op].tensors(Level.FULL)) for op in registry)}
    out.update(pinned_bandwidth(registry, 5))
    with tempfile.TemporaryDirectory(prefix="moe_ft_gpu_bench_", dir=a.store_root) as root:
        out.update(engine_bandwidth(registry, root, a.iters))
        out["engine_vs_pinned"] = out["engine_gbps"] / out["pinned_copy_gbps"]
        out["mapped"] = engine_bandwidth(registry, root, a.iters, mapped=True)
        out["mapped"]["engine_vs_pinned"] = out["mapped"]["engine_gbps"] / out["pinned_copy_gbps"]
        if a.thread_sweep:
            out["store_write_gbps_by_threads"] = {
                n: round(engine_bandwidth(registry, root, 2, write_threads=n)["store_write_gbps"], 3) for n in (1, 8)}
        out["stall"] = [stall_loop(registry, root, iters=a.stall_iters, compute_ms=a.compute_ms, window=a.window,
                                   full=full, slots=a.slots, mapped=mapped)
                        for full in (False, True) for mapped in (False, True)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
