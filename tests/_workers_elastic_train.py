"""torchrun worker: ``pretrain_gpt_moe.py``'s own argument groups and training loop; rank 0 writes the loss
and gradient norm of every iteration to ``--out``/losses.json, and the replica map ``R[e, j]`` of every
elastic MoE layer (keyed by 0-based layer index) as ``plans``.

    torchrun --nproc-per-node 4 tests/_workers_elastic_train.py --out DIR <pretrain_gpt_moe.py flags>
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    import torch.distributed as dist

    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from megatron.training.training import StepHooks
    from pretrain_gpt_moe import extra_argument_groups

    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1]
    del argv[argv.index("--out"): argv.index("--out") + 2]
    args = parse_args(argv, extra_groups=extra_argument_groups())
    record = {"losses": [], "grad_norms": [], "plans": {}}

    class Record(StepHooks):
        def on_train_start(self, state, data, args, start_iteration):
            for layer in state.model[0].module.decoder.layers:
                replicas = getattr(layer.mlp, "replicas", None)
                if replicas is not None:
                    record["plans"][layer.layer_number - 1] = replicas.tolist()
            return start_iteration

        def on_step_end(self, iteration, step):
            record["losses"].append(step.loss)
            record["grad_norms"].append(step.grad_norm)

        def on_train_end(self, report):
            if dist.get_rank() == 0:
                with open(os.path.join(out, "losses.json"), "w") as f:
                    json.dump(record, f)

    os.makedirs(out, exist_ok=True)
    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    pretrain(args, hooks=Record())
    return 0


if __name__ == "__main__":
    sys.exit(main())
