"""torchrun worker: the elastic MoE layer against Megatron's standard EP layer (alltoall dispatcher).

    torchrun --nproc-per-node 4 tests/_workers_elastic_layer.py --out DIR

For EP = 4 (one EP group) and EP = 2 (two EP groups) and several replica plans (the standard layout, and
random uneven replica counts placed by every strategy, some with several slots of one expert on one rank),
both layers are built from the same seeds, run on the same per-rank input with balanced or skewed routing,
and back-propagate the same random output gradient. Writes ``result_rank{r}.json`` with, per case, whether
replica weights equal the standard expert weights bitwise and the largest differences of the output, the
input gradient, the router gradient and every expert replica's gradient (vs the standard owner's gradient).
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_EXPERTS, HIDDEN, FFN, SEQ, BATCH, TOPK = 4, 16, 32, 8, 3, 2


def _config(ep: int):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, add_bias_linear=False, use_cpu_initialization=False,
        params_dtype=torch.float32, gradient_accumulation_fusion=False,
    )


def _plans(ep: int, rng: random.Random) -> list[dict]:
    """ElasticConfig keyword sets: the standard layout, then random uneven allocations."""
    cases = [{}]
    for slots in (2, 3) if ep == 2 else (1, 2):
        for strategy in ("compact", "spread", "mro", "optimal"):
            total = ep * slots
            cuts = sorted(rng.sample(range(1, total), NUM_EXPERTS - 1))
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
            cases.append({"ft_expert_replicas": [str(c) for c in counts], "ft_expert_slots": slots,
                          "ft_placement": strategy})
    return cases


def _max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _check(ep: int, kwargs: dict, skew: bool, seed: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from moe_ft.elastic.config import FLEXIBLE, ElasticConfig
    from moe_ft.megatron_ext.elastic_moe_layer import elastic_mlp_spec

    config = _config(ep)
    mlp_spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False).submodules.mlp
    elastic = ElasticConfig(**kwargs)

    def build(spec, cfg):
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        layer = build_module(spec, config=cfg)
        layer.set_layer_number(1)
        if skew:  # most tokens pick expert 0 (same change in both layers)
            with torch.no_grad():
                layer.router.weight[0] += 2.0
        return layer

    standard = build(mlp_spec, config)
    flex_config = copy.copy(config)
    flex_config.moe_token_dispatcher_type = FLEXIBLE
    flexible = build(elastic_mlp_spec(mlp_spec, elastic), flex_config)

    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    grad_out = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    results = {}
    for name, layer in (("standard", standard), ("flexible", flexible)):
        inp = x.clone().requires_grad_(True)
        out, _ = layer(inp)
        (out * grad_out).sum().backward()
        results[name] = (out.detach(), inp.grad)

    ep_group = ps.get_expert_model_parallel_group()
    ep_rank = dist.get_rank(ep_group)
    num_local = NUM_EXPERTS // ep

    def flat(mlp, attr):
        return torch.cat([(p.grad if attr == "grad" else p.detach()).reshape(-1) for p in mlp.parameters()])

    owned = {ep_rank * num_local + i: (flat(m, "data"), flat(m, "grad"))
             for i, m in enumerate(standard.experts.local_experts)}
    gathered = [None] * ep
    dist.all_gather_object(gathered, owned, group=ep_group)
    reference = {e: v for d in gathered for e, v in d.items()}
    weights_equal, expert_grad_diff, expert_grad_scale = True, 0.0, 0.0
    for e, mlp in zip(flexible.experts.held_experts, flexible.experts.local_experts):
        weights_equal &= bool(torch.equal(flat(mlp, "data"), reference[e][0]))
        expert_grad_diff = max(expert_grad_diff, _max_diff(flat(mlp, "grad"), reference[e][1]))
        expert_grad_scale = max(expert_grad_scale, float(reference[e][1].abs().max()))
    (out_s, gin_s), (out_f, gin_f) = results["standard"], results["flexible"]
    return {
        "ep": ep, "plan": kwargs, "skew": skew,
        "replicas": flexible.token_dispatcher.replicas.tolist(),
        "held_experts": flexible.experts.held_experts,
        "weights_equal": weights_equal,
        "out_bitwise": bool(torch.equal(out_s, out_f)), "out_diff": _max_diff(out_s, out_f),
        "input_grad_bitwise": bool(torch.equal(gin_s, gin_f)), "input_grad_diff": _max_diff(gin_s, gin_f),
        "router_grad_bitwise": bool(torch.equal(standard.router.weight.grad, flexible.router.weight.grad)),
        "router_grad_diff": _max_diff(standard.router.weight.grad, flexible.router.weight.grad),
        "expert_grad_diff": expert_grad_diff, "expert_grad_scale": expert_grad_scale,
        "recv_rows": int(flexible.token_dispatcher.schedule.recv_counts.sum()),
    }


def main() -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import quiet_optional_dependency_warnings
    from moe_ft.compat import cpu as cpu_compat

    out_dir = sys.argv[sys.argv.index("--out") + 1]
    quiet_optional_dependency_warnings()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu_compat.activate()
    rng = random.Random(7)  # same plans on every rank
    cases = []
    for ep in (4, 2):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=ep)
        for i, kwargs in enumerate(_plans(ep, rng)):
            cases.append(_check(ep, kwargs, skew=bool(i % 2), seed=1000 + i))
    with open(os.path.join(out_dir, f"result_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(cases, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
