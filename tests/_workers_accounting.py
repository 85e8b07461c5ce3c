"""torchrun worker for tests/test_byte_accounting.py: for each layout (``--layout "<flags>"``, repeatable)
build the real model + optimizer, train one iteration, build the registry and the global catalogue, then
hand the plans of every policy (dense, pec, selective, sparse) to this rank's real snapshot engine and
record what it copied next to what the catalogue charges this rank's key. Writes ``result_rank<r>.json``.

    torchrun --nproc-per-node 4 tests/_workers_accounting.py --out DIR --data-path P --layout "..." [...]
"""

from __future__ import annotations

import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._ft_helpers import tiny_model_flags  # noqa: E402  (needs the repository on sys.path)

MODEL = tiny_model_flags(train_iters=2)
ITERATIONS = range(6)  # two sparse windows of 3


def policies(catalogue):
    from moe_ft.policy import (
        DenseConfig,
        DensePolicy,
        PECConfig,
        PECPolicy,
        SelectiveConfig,
        SelectivePolicy,
        SparseConfig,
        SparsePolicy,
    )
    from moe_ft.state.catalogue import copied_bytes
    from moe_ft.state.operators import Level

    non_expert = {i.op: Level.FULL for i in catalogue if not i.op.is_expert}
    budget = max(copied_bytes(non_expert, catalogue).values()) + 2 * max(i.bytes_full for i in catalogue)
    return {"dense": DensePolicy(DenseConfig(interval=1), catalogue),
            "pec": PECPolicy(PECConfig(k_snapshot=1), catalogue),
            "selective": SelectivePolicy(SelectiveConfig(local_budget=budget, remote_budget=budget), catalogue),
            "sparse": SparsePolicy(SparseConfig(window=3), catalogue)}


def check_layout(flags: list[str], data_path: str, out_dir: str, idx: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed, set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train_step
    from moe_ft.compat import activate_all
    from moe_ft.popularity import ExpertPopularity, PopularityConfig
    from moe_ft.snapshot import EngineConfig, SnapshotEngine
    from moe_ft.state.catalogue import copied_bytes, copied_bytes_per_rank, gather_catalogue
    from moe_ft.state.registry import OperatorRegistry
    from moe_ft.store import StoreConfig

    args = parse_args([*MODEL, *flags, "--data-path", data_path])
    activate_all()
    initialize_distributed(args)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    train_step(state, build_data(args), 0, args)
    reg = OperatorRegistry.from_megatron(state.model, state.optimizer)
    catalogue = gather_catalogue(reg.infos(), reg.ep_size)
    key = (reg.pp_rank, reg.ep_rank)
    rank = dist.get_rank()
    store = StoreConfig(root=out_dir, job_id=f"layout{idx}", rank=rank).build()
    engine = SnapshotEngine(EngineConfig(num_slots=1), reg, store)
    popularity = ExpertPopularity(PopularityConfig(moe_layers=[0, 1], num_experts=4))
    rows, n = [], 0
    try:
        for name, policy in policies(catalogue).items():
            for t in ITERATIONS:
                plan = policy.plan(t, popularity)
                record = engine.submit(n, plan, {"policy": name}, {})
                engine.flush()
                n += 1
                home = sum(i.nbytes(plan[i.op]) for i in catalogue if (i.pp_rank, i.ep_rank) == key)
                mine = {r: b for (r, _), b in copied_bytes_per_rank(plan, catalogue).items()}.get(rank, 0)
                rows.append({"policy": name, "iteration": t, "key": list(key), "engine_bytes": record.bytes,
                             "charged_rank": mine, "registry_bytes": reg.nbytes(plan),
                             "charged": {f"{pp},{ep}": b for (pp, ep), b in copied_bytes(plan, catalogue).items()},
                             "home_bytes": home})
    finally:
        engine.close()
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return rows


def main() -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1]
    data_path = argv[argv.index("--data-path") + 1]
    layouts = [shlex.split(argv[i + 1]) for i, a in enumerate(argv) if a == "--layout"]
    results = [check_layout(flags, data_path, out, idx) for idx, flags in enumerate(layouts)]
    with open(os.path.join(out, f"result_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    from megatron.training.initialize import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
