"""Layer throughput of the flexible dispatcher under skewed expert loads (Lazarus Fig. 10a), CPU/gloo
(on a GPU: ``tools/bench/gpu_dispatch.py`` measures the dispatch permutation).

    python -m tools.bench.dispatch layer --world 2 --experts 8 --hidden 256 --ffn 1024 --tokens 4096

Spawns ``--world`` processes (one EP group), builds Megatron's MoE layer twice -- standard EP (alltoall
dispatcher, ``E/W`` experts per rank) and ``ElasticMoELayer`` with the eq. 1 allocation for the load (f = 1) and
the ``optimal`` placement over ``--slots`` replica slots per rank (default ``2E/W``: eq. 1 needs spare slots
to replicate anything; with ``E/W`` slots every expert gets exactly one replica) -- and times forward and forward+backward of the
layer's dispatch -> experts -> combine path on a synthetic top-1 routing where expert 0 receives ``ratio``
times the even share of tokens (``ratio:1``), the other experts share the rest evenly. The router is
bypassed so the load is exactly the one asked for. Reports global tokens/s (median over ``--iters``).
"""

from __future__ import annotations

import os
import statistics
import time


def _routing(num_tokens: int, num_experts: int, ratio: float, seed: int):
    import torch

    hot = round(ratio * num_tokens / num_experts)
    rest = num_tokens - hot
    counts = [hot] + [rest // (num_experts - 1) + (i < rest % (num_experts - 1)) for i in range(num_experts - 1)]
    gen = torch.Generator().manual_seed(seed)
    expert = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))[torch.randperm(num_tokens, generator=gen)]
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map[torch.arange(num_tokens), expert] = True
    probs = routing_map.float() * (0.5 + 0.5 * torch.rand(num_tokens, 1, generator=gen))
    return routing_map, probs, counts


def _time_layer(layer, hidden, probs, routing_map, iters: int, backward: bool) -> float:
    import torch
    import torch.distributed as dist

    times = []
    for step in range(iters + 1):
        x = hidden.clone().requires_grad_(backward)
        dist.barrier()
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            h, p = layer.preprocess(x, probs, routing_map)
            h, p = layer.dispatch(h, p)
            out, _ = layer.routed_experts_compute(h, p)
            out = layer.postprocess(layer.combine(out), None)
            if backward:
                out.backward(torch.ones_like(out))
        dist.barrier()
        if step:  # the first iteration warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, opts: dict, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.training.initialize import quiet_optional_dependency_warnings

    quiet_optional_dependency_warnings()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ft.compat import cpu as cpu_compat
    from moe_ft.elastic.config import FLEXIBLE, ElasticConfig
    from moe_ft.megatron_ext.elastic_moe_layer import elastic_mlp_spec
    from moe_ft.placement.allocation import allocate_replicas

    cpu_compat.activate()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    E, n = opts["experts"], opts["tokens"]
    slots = opts["slots"] or 2 * E // world
    mlp_spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp

    def config(dispatcher):
        return TransformerConfig(
            num_layers=1, hidden_size=opts["hidden"], num_attention_heads=4, ffn_hidden_size=opts["ffn"],
            moe_ffn_hidden_size=opts["ffn"], num_moe_experts=E, moe_router_topk=1, moe_router_pre_softmax=True,
            moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=world, add_bias_linear=False,
            params_dtype=torch.float32, gradient_accumulation_fusion=False)

    torch.manual_seed(0)
    hidden = torch.randn(n, 1, opts["hidden"])
    standard = build_module(mlp_spec, config=config("alltoall"))
    for ratio in opts["ratios"]:
        routing_map, probs, counts = _routing(n, E, ratio, seed=rank)
        replicas = allocate_replicas([c * world for c in counts], num_nodes=world, slots_per_node=slots,
                                     min_replicas=1)
        elastic = ElasticConfig(ft_expert_replicas=[str(r) for r in replicas], ft_expert_slots=slots)
        flexible = build_module(elastic_mlp_spec(mlp_spec, elastic), config=config(FLEXIBLE))
        for name, layer in (("standard EP", standard), ("replicated", flexible)):
            fwd = _time_layer(layer, hidden, probs, routing_map, opts["iters"], backward=False)
            train = _time_layer(layer, hidden, probs, routing_map, opts["iters"], backward=True)
            if rank == 0:
                results.append((ratio, name, replicas if name == "replicated" else [1] * E,
                                world * n / fwd, world * n / train))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def bench_layer(args) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.experts % args.world:
        raise SystemExit(f"--experts {args.experts} must be divisible by --world {args.world} (standard EP)")
    opts = {"experts": args.experts, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
            "iters": args.iters, "ratios": args.ratios, "slots": args.slots}
    with mp.Manager() as manager:
        results = manager.list()
        mp.start_processes(_worker, args=(args.world, port, opts, results), nprocs=args.world, start_method="spawn")
        rows = list(results)
    slots = args.slots or 2 * args.experts // args.world
    print(f"MoE layer, {args.world} ranks (gloo), {args.experts} experts top-1, hidden {args.hidden}, ffn "
          f"{args.ffn}, {args.tokens} tokens/rank, replicated: {slots} slots/rank; global tokens/s "
          f"(median of {args.iters})")
    print(f"{'load':>5} {'placement':<12} {'replicas per expert':<26} {'forward':>10} {'fwd+bwd':>10}")
    for ratio, name, replicas, fwd, train in rows:
        print(f"{ratio:>3g}:1 {name:<12} {str(replicas):<26} {fwd:10.0f} {train:10.0f}")
