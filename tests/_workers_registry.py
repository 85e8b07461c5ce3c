"""torchrun worker for the registry tests: for each layout (``--layout "<flags>"``, repeatable) build the
real model + optimizer, run one training iteration (Adam state exists after the first step), decompose it
with the operator registry and check the decomposition against an independent walk of the Megatron
optimizer. Writes ``result_rank<r>.json`` into ``--out``.

    torchrun --nproc-per-node 4 tests/_workers_registry.py --out DIR --data-path P --layout "..." [--layout ...]
"""

from __future__ import annotations

import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._ft_helpers import tiny_model_flags  # noqa: E402  (needs the repository on sys.path)

MODEL = tiny_model_flags(train_iters=2)


def independent_tensors(state):
    """Every model parameter and every optimizer tensor, found without the registry: model params, the torch
    optimizers' params (masters) and their state tensors. Returns (params, masters, optim) lists."""
    from moe_ft.state.optimizer_views import leaf_optimizers

    params = [p for chunk in state.model for p in chunk.module.parameters()]
    masters, optim = [], []
    for opt in leaf_optimizers(state.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                masters.append(p)
                optim.extend(v for v in opt.optimizer.state[p].values() if hasattr(v, "nbytes"))
    return params, masters, optim


def check_layout(flags: list[str], data_path: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed, set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train_step
    from moe_ft.state import shards
    from moe_ft.state.catalogue import gather_catalogue
    from moe_ft.state.operators import Level
    from moe_ft.state.registry import OperatorRegistry

    args = parse_args([*MODEL, *flags, "--data-path", data_path])
    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    initialize_distributed(args)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    train_step(state, build_data(args), 0, args)
    reg = OperatorRegistry.from_megatron(state.model, state.optimizer)

    owner: dict[int, list[str]] = {}  # storage address+shape key -> operators holding that tensor
    for op, st in reg.operators.items():
        for t in st.tensors(Level.FULL).values():
            owner.setdefault(id(t), []).append(str(op))
    params, masters, optim = independent_tensors(state)
    storage = {p.untyped_storage().data_ptr() for p in params}
    separate_masters = [m for m in masters if m.untyped_storage().data_ptr() not in storage]
    bad = [k for k, v in owner.items() if len(v) != 1]
    unowned = [t for t in [*params, *separate_masters, *optim] if id(t) not in owner]
    indep_bytes = sum(t.nbytes for t in [*params, *separate_masters, *optim])
    buffers = sum(t.nbytes for st in reg.operators.values() for n, t in st.compute.items() if n.endswith("expert_bias"))
    infos = reg.infos()
    shard_ok = all(  # every sharded tensor is named with its range (moe_ft/state/shards.py)
        st.optim[shards.tag("exp_avg", start, end, st.sharded[name], name)].numel() == end - start
        for st in reg.operators.values() for name, (start, end) in st.shards.items())
    catalogue = gather_catalogue(infos, reg.ep_size)
    out = {
        "layout": flags,
        "num_operators": len(reg),
        "multiply_owned": len(bad), "unowned": len(unowned),
        "registry_bytes_full": sum(i.bytes_full for i in infos),
        "independent_bytes": indep_bytes + buffers,
        "registry_bytes_compute": sum(i.bytes_compute for i in infos),
        "param_bytes": sum(p.nbytes for p in params) + buffers,
        "sizes_match_tensors": all(
            i.bytes_full == sum(t.nbytes for t in reg[i.op].tensors(Level.FULL).values())
            and i.bytes_compute == sum(t.nbytes for t in reg[i.op].tensors(Level.COMPUTE).values()) for i in infos),
        "num_masters_separate": len(separate_masters),
        "num_aliased": sum(len(st.aliased_masters) for st in reg.operators.values()),
        "num_optim": len(optim),
        "shards": sum(len(st.shards) for st in reg.operators.values()),
        "shard_sizes_ok": shard_ok,
        "experts": sorted(str(op) for op in reg if op.is_expert),
        "ep_rank": reg.ep_rank, "pp_rank": reg.pp_rank,
        "catalogue": [str(i.op) for i in catalogue],
        "catalogue_keys": [[i.pp_rank, i.ep_rank] for i in catalogue],
    }
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return out


def main() -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1]
    data_path = argv[argv.index("--data-path") + 1]
    layouts = [shlex.split(argv[i + 1]) for i, a in enumerate(argv) if a == "--layout"]
    results = [check_layout(flags, data_path) for flags in layouts]
    rank = dist.get_rank()
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    from megatron.training.initialize import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
