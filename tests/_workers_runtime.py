"""torchrun worker for the runtime tests: trains through ``pretrain_gpt_moe``'s seams with the FT runtime,
capturing (on the training thread, right before the engine starts) clones of the live tensors of every
operator this rank snapshots; after training it checks the store against those clones and writes
``result_rank<r>.json`` into ``--out``. With ``--sleep-after N`` it sleeps after iteration N (the kill
test SIGKILLs it there).

    torchrun --nproc-per-node 4 tests/_workers_runtime.py --out DIR [--sleep-after N] <Megatron and --ft flags>
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch
    import torch.distributed as dist

    import pretrain_gpt_moe
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from moe_ft.runtime.hooks import FTRuntime
    from moe_ft.state.operators import Level

    argv = sys.argv[1:]
    out = argv.pop(argv.index("--out") + 1)
    argv.remove("--out")
    sleep_after = None
    if "--sleep-after" in argv:
        sleep_after = int(argv.pop(argv.index("--sleep-after") + 1))
        argv.remove("--sleep-after")
    args = parse_args(argv, extra_groups=pretrain_gpt_moe.extra_argument_groups())
    captured: dict = {}

    class Capture(FTRuntime):
        def on_snapshot(self, iteration, plan):
            captured[iteration] = {op: (lvl, {n: t.detach().clone() for n, t in self.registry[op].tensors(lvl).items()})
                                   for op, lvl in plan.items() if lvl != Level.NONE and op in self.registry}

        def on_step_end(self, iteration, result):
            super().on_step_end(iteration, result)
            if sleep_after is not None and iteration == sleep_after:
                self.sessions[0].engine.flush()
                ready = os.path.join(out, f"ready_rank{dist.get_rank()}")
                with open(ready + ".tmp", "w") as f:
                    f.write(str(os.getpid()))  # the test SIGKILLs this pid (torchrun gives workers own sessions)
                os.rename(ready + ".tmp", ready)  # appears complete
                time.sleep(600)

    runtime = Capture(args.extra["FTConfig"])
    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    pretrain(args, hooks=runtime)

    session = runtime.sessions[0]
    store, policy, reg = session.store, session.policy, runtime.registry
    catalog = store.catalog()
    last = args.training.train_iters - 1
    window = policy.recovery_window(last + 1)  # the newest complete window
    lo, hi = window.start, window.end - 1
    full_in_window = {str(op): any(catalog.level(t, op) == Level.FULL for t in range(lo, hi + 1)
                                   if t in catalog.iterations) for op in reg}
    mismatches, compared = [], 0
    for t in catalog.iterations:
        for op, (lvl, tensors) in captured.get(t, {}).items():
            loaded = store.load(t, op, lvl)  # checksum-verified
            compared += 1
            if set(loaded) != set(tensors) or not all(torch.equal(loaded[n], tensors[n]) for n in tensors):
                mismatches.append(f"{op}@{t}")
    records = session.engine.records
    result = {
        "iterations": catalog.iterations, "window": [lo, hi], "full_in_window": full_in_window,
        "compared": compared, "mismatches": mismatches,
        "bytes_per_iter": [r.bytes for r in records],
        "dense1_bytes": sum(reg[op].nbytes(Level.FULL) for op in reg),
        "meta_keys": sorted(store.load_meta(last).meta) if last in catalog.iterations else [],
        "window_bandwidth": getattr(policy.config, "bandwidth_bytes_per_s", None),  # sparse, window="auto"
    }
    with open(os.path.join(out, f"result_rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
