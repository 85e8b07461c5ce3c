"""Benchmarks of the Lazarus placement and the flexible dispatcher.

    python -m tools.bench.dispatch placement --nodes 1024 --slots 4 --experts 64
    python -m tools.bench.dispatch permute                 # CPU: Triton interpreter, correctness only
    python -m tools.bench.dispatch permute --tokens 16384 --hidden 4096 --topk 8 --experts 64 --world 64  # CUDA
    python -m tools.bench.dispatch layer --world 2 --experts 8   # layer tokens/s, skewed loads (dispatch_layer.py)

``placement`` times eq. 1, MRO, the exact recovery probabilities, the ``optimal`` local search, the
greedy node mapping after one failure and the dispatch schedule for one rank. ``permute`` checks the Triton
permutation against the reference; with a CUDA device it also reports GB/s (read + write of the send
buffer) of the reference, the Triton gather, a device-to-device copy of the same bytes and Megatron's
``moe_utils.permute`` (routing-map based, when megatron-core imports).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from moe_ft.placement.search import SearchConfig


def _timed(fn, repeat: int = 1):
    best = float("inf")
    out = None
    for _ in range(repeat):
        start = time.process_time()  # CPU time of this (single-threaded) process: robust on a shared machine
        out = fn()
        best = min(best, time.process_time() - start)
    return out, best


def bench_placement(args) -> None:
    from moe_ft.megatron_ext.dispatch.schedule import dispatch_schedule
    from moe_ft.placement.allocation import allocate_replicas
    from moe_ft.placement.migration import map_nodes
    from moe_ft.placement.plans import mro_plan
    from moe_ft.placement.reliability import recovery_probabilities
    from moe_ft.placement.search import optimal_plan

    gen = torch.Generator().manual_seed(0)
    loads = (torch.randn(args.experts, generator=gen).exp() * 1000).round().tolist()  # log-normal loads
    n, c = args.nodes, args.slots
    r, allocation_t = _timed(lambda: allocate_replicas(loads, num_nodes=n, slots_per_node=c, min_replicas=args.f), 3)
    print(f"eq. 1 allocation           {allocation_t * 1e3:9.2f} ms   (min {min(r)}, max {max(r)} replicas)")
    plan, mro_t = _timed(lambda: mro_plan(r, n, c), 3)
    print(f"MRO plan                   {mro_t * 1e3:9.2f} ms")
    ks = list(range(0, args.max_failed + 1))
    probs, t = _timed(lambda: recovery_probabilities(plan, args.experts, ks), 3)
    print(f"recovery P(k), k=0..{args.max_failed:<3d}  {t * 1e3:9.2f} ms   [{probs[args.max_failed].method}] "
          f"P({args.max_failed}) = {probs[args.max_failed].probability:.6f}")
    cfg = SearchConfig(max_exact_plans=0, max_objective_failures=args.max_failed, max_evaluations=args.evaluations)
    best, t = _timed(lambda: optimal_plan(r, n, c, cfg))
    print(f"optimal (local, {best.evaluations} evals) {t * 1e3:9.2f} ms   start={best.start}")
    total = allocation_t + mro_t + t
    print(f"total allocation + optimal plan: {total * 1e3:.1f} ms CPU (MRO only: {(allocation_t + mro_t) * 1e3:.1f} ms)")
    held = {p: plan[p] for p in range(n) if p != 0}
    held[n] = ()  # node 0 failed, a fresh node n joined
    new_plan = mro_plan(allocate_replicas(loads, num_nodes=n, slots_per_node=c, min_replicas=args.f), n, c)
    _, t = _timed(lambda: map_nodes(held, new_plan, args.experts))
    print(f"greedy node mapping        {t * 1e3:9.2f} ms   ({n} x {n} pairs)")
    replicas = torch.zeros(args.experts, n, dtype=torch.int64)
    for node_idx, node in enumerate(plan):
        for e in node:
            replicas[e, node_idx] += 1
    tpe = torch.randint(0, 64, (args.experts, n), generator=gen)
    _, t = _timed(lambda: dispatch_schedule(tpe, replicas, 3), 5)
    print(f"dispatch schedule, 1 rank  {t * 1e3:9.2f} ms   (E={args.experts}, W={n})")


def bench_permute(args) -> None:
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before permute_triton is imported
    from moe_ft.megatron_ext.dispatch.arithmetic import DispatchConfig, build_permutation, dispatch_schedule, permute

    device = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    tokens, topk, experts, world = args.tokens, args.topk, args.experts, args.world
    routing = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    replicas = torch.ones(experts, world, dtype=torch.int64)
    tpe = torch.randint(0, 2 * tokens * topk // experts + 1, (experts, world), generator=gen)
    tpe[:, 0] = torch.bincount(routing.reshape(-1), minlength=experts)
    sched = dispatch_schedule(tpe, replicas, 0)
    routing = routing.to(device)
    hidden = torch.randn(tokens, args.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    ref_cfg, tri_cfg = DispatchConfig(backend="torch"), DispatchConfig(backend="triton")
    perm_ref = build_permutation(routing, sched, ref_cfg)
    perm_tri = build_permutation(routing, sched, tri_cfg)
    same = torch.equal(perm_ref.slot_of_pos, perm_tri.slot_of_pos) and torch.equal(
        permute(hidden, perm_ref, ref_cfg), permute(hidden, perm_tri, tri_cfg)
    )
    print(f"device={device} tokens={tokens} topk={topk} hidden={args.hidden} experts={experts} world={world}: "
          f"triton == reference: {same}")
    if not same:
        raise SystemExit(1)
    if not cuda:
        _, t_ref = _timed(lambda: permute(hidden, perm_ref, ref_cfg), 3)
        _, t_tri = _timed(lambda: permute(hidden, perm_tri, tri_cfg), 1)
        print(f"CPU timings (interpreter; not a performance number): reference {t_ref * 1e3:.2f} ms, "
              f"triton-interpreted {t_tri * 1e3:.1f} ms")
        return
    nbytes = 2 * tokens * topk * args.hidden * hidden.element_size()

    def gbps(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return nbytes / (start.elapsed_time(end) / args.iters * 1e-3) / 1e9

    src = torch.empty(tokens * topk, args.hidden, dtype=hidden.dtype, device=device)
    dst = torch.empty_like(src)
    print(f"device-to-device copy      {gbps(lambda: dst.copy_(src)):8.1f} GB/s")
    print(f"reference permute (torch)  {gbps(lambda: permute(hidden, perm_ref, ref_cfg)):8.1f} GB/s")
    print(f"triton permute             {gbps(lambda: permute(hidden, perm_tri, tri_cfg)):8.1f} GB/s")
    print(f"triton positions+permute   {gbps(lambda: permute(hidden, build_permutation(routing, sched, tri_cfg), tri_cfg)):8.1f} GB/s")
    try:
        from megatron.core.transformer.moe.moe_utils import permute as megatron_permute
    except ImportError as err:
        print(f"megatron permute           unavailable ({err})")
        return
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    routing_map.scatter_(1, routing, True)
    print(f"megatron moe_utils.permute {gbps(lambda: megatron_permute(hidden, routing_map, num_out_tokens=tokens * topk)):8.1f} GB/s")


def _bench_layer(args) -> None:
    from tools.bench.dispatch_layer import bench_layer

    bench_layer(args)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    parser = argparse.ArgumentParser(description="Lazarus placement and dispatcher benchmarks")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("placement")
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--f", type=int, default=2)
    p.add_argument("--max-failed", type=int, default=8)
    p.add_argument("--evaluations", type=int, default=SearchConfig().max_evaluations)
    p.set_defaults(func=bench_placement)
    q = sub.add_parser("permute")
    q.add_argument("--tokens", type=int, default=64)
    q.add_argument("--hidden", type=int, default=32)
    q.add_argument("--topk", type=int, default=2)
    q.add_argument("--experts", type=int, default=8)
    q.add_argument("--world", type=int, default=4)
    q.add_argument("--iters", type=int, default=20)
    q.set_defaults(func=bench_permute)
    la = sub.add_parser("layer", help="MoE layer tokens/s, standard EP vs replicated, skewed loads (Fig. 10a)")
    la.add_argument("--world", type=int, default=2)
    la.add_argument("--experts", type=int, default=8)
    la.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    la.add_argument("--hidden", type=int, default=256)
    la.add_argument("--ffn", type=int, default=1024)
    la.add_argument("--iters", type=int, default=5)
    la.add_argument("--slots", type=int, default=None, help="replica slots per rank (default 2 x experts/world)")
    la.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    la.set_defaults(func=_bench_layer)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
