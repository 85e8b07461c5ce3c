"""Triton dispatch permutation on CUDA vs a device-to-device copy of the same bytes and vs Megatron's
``moe_utils.permute``, side by side in one run.

    python -m tools.bench.gpu_dispatch [--tokens 16384 --hidden 4096 --topk 8 --experts 64 --world 8]

Prints one JSON object. Every rate is GB/s of send-buffer traffic (read + write of
``tokens * topk * hidden`` elements, bf16), timed with CUDA events over ``--iters`` calls after warm-up:
``d2d_copy`` (``dst.copy_(src)`` of the same bytes: the memory-bandwidth ceiling), ``torch_reference``
(``moe_ft/megatron_ext/dispatch/permute_ref.py``), ``triton_gather`` (the permutation kernel alone, positions
precomputed), ``triton_positions_and_gather`` (positions kernel + gather, what a dispatch pays),
``megatron_permute`` (routing-map based, ``fused=False``: Transformer Engine's fused permute is absent).
``vs_copy`` holds each rate's ratio to ``d2d_copy``. ``equal``: Triton == reference bitwise (positions and rows).
"""

from __future__ import annotations

import argparse
import json

import torch


def _gbps(fn, nbytes: int, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return nbytes / (start.elapsed_time(end) / iters * 1e-3) / 1e9


def bench(*, tokens: int, hidden: int, topk: int, experts: int, world: int, iters: int, seed: int = 0) -> dict:
    from moe_ft.megatron_ext.dispatch.arithmetic import DispatchConfig, build_permutation, dispatch_schedule, permute

    device = "cuda"
    gen = torch.Generator().manual_seed(seed)
    routing = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    replicas = torch.ones(experts, world, dtype=torch.int64)
    tpe = torch.randint(0, 2 * tokens * topk // experts + 1, (experts, world), generator=gen)
    tpe[:, 0] = torch.bincount(routing.reshape(-1), minlength=experts)
    sched = dispatch_schedule(tpe, replicas, 0)
    routing = routing.to(device)
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    ref_cfg, tri_cfg = DispatchConfig(backend="torch"), DispatchConfig(backend="triton")
    perm_ref = build_permutation(routing, sched, ref_cfg)
    perm_tri = build_permutation(routing, sched, tri_cfg)
    equal = bool(torch.equal(perm_ref.slot_of_pos, perm_tri.slot_of_pos) and torch.equal(
        permute(hidden_states, perm_ref, ref_cfg), permute(hidden_states, perm_tri, tri_cfg)))
    nbytes = 2 * tokens * topk * hidden * hidden_states.element_size()
    src = torch.empty(tokens * topk, hidden, dtype=hidden_states.dtype, device=device)
    dst = torch.empty_like(src)
    out = {"device": torch.cuda.get_device_name(), "tokens": tokens, "hidden": hidden, "topk": topk,
           "experts": experts, "world": world, "bytes": nbytes, "equal": equal}
    rates = {
        "d2d_copy": _gbps(lambda: dst.copy_(src), nbytes, iters),
        "torch_reference": _gbps(lambda: permute(hidden_states, perm_ref, ref_cfg), nbytes, iters),
        "triton_gather": _gbps(lambda: permute(hidden_states, perm_tri, tri_cfg), nbytes, iters),
        "triton_positions_and_gather": _gbps(
            lambda: permute(hidden_states, build_permutation(routing, sched, tri_cfg), tri_cfg), nbytes, iters),
    }
    try:
        from megatron.core.transformer.moe.moe_utils import permute as megatron_permute
    except ImportError as err:
        out["megatron_permute_error"] = str(err)
    else:
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
        routing_map.scatter_(1, routing, True)
        rates["megatron_permute"] = _gbps(
            lambda: megatron_permute(hidden_states, routing_map, num_out_tokens=tokens * topk), nbytes, iters)
    out["gbps"] = {k: round(v, 1) for k, v in rates.items()}
    out["vs_copy"] = {k: round(v / rates["d2d_copy"], 3) for k, v in rates.items() if k != "d2d_copy"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_dispatch needs CUDA (CPU correctness: python -m tools.bench.dispatch permute)")
    res = bench(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts, world=a.world, iters=a.iters)
    print(json.dumps(res))
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
