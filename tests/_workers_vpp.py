"""torchrun worker of ``tests/test_vpp.py``: the interleaved pipeline schedule (virtual pipeline stages) in
the training loop, on 4 gloo ranks (PP=2 x EP=2, two model chunks per rank).

Builds the real state with ``--num-layers-per-virtual-pipeline-stage 1`` (4 layers), records where every
layer, the embedding and the output layer sit, decomposes the chunks with the operator registry, trains 2
iterations, evaluates (forward only), saves a ``dist_checkpointing`` checkpoint, trains 2 more and digests
this rank's whole state; then loads the checkpoint back, trains the same 2 iterations again and digests
again. Writes
``result_rank<r>.json`` into ``--out``.

    torchrun --nproc-per-node 4 tests/_workers_vpp.py --out DIR --data-path P
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._ft_helpers import tiny_model_flags  # noqa: E402  (needs the repository on sys.path)

FLAGS = tiny_model_flags("pp2vp2", seq_length=16, max_position_embeddings=16, train_iters=4,
                         lr_warmup_iters=1)


def main() -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.initialize import initialize_distributed, set_seeds, shutdown
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import evaluate, train_step
    from moe_ft.compat import activate_all
    from moe_ft.digest import local_state_tensors, tensor_digest
    from moe_ft.state.catalogue import gather_catalogue
    from moe_ft.state.registry import OperatorRegistry

    torch.set_num_threads(1)
    argv = sys.argv[1:]
    out, data_path = argv[argv.index("--out") + 1], argv[argv.index("--data-path") + 1]
    save = os.path.join(out, "ckpt")
    args = parse_args([*FLAGS, "--data-path", data_path, "--save", save])
    activate_all()
    initialize_distributed(args)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    data = build_data(args)
    chunks = [{"layers": [int(layer.layer_number) for layer in chunk.module.decoder.layers],
               "pre_process": chunk.module.pre_process, "post_process": chunk.module.post_process}
              for chunk in state.model]
    losses = [train_step(state, data, it, args).loss for it in range(2)]
    eval_loss = evaluate(state, data, args)  # forward-only interleaved schedule, broadcast from the last stage
    registry = OperatorRegistry.from_megatron(state.model, state.optimizer)  # Adam state exists now
    catalogue = gather_catalogue(registry.infos(), registry.ep_size)
    save_checkpoint(save, 2, state)

    def digest_after_two_more() -> tuple[str, list[float]]:
        run = [train_step(state, data, it, args).loss for it in (2, 3)]
        return tensor_digest(local_state_tensors(state.model, state.optimizer, state.scheduler)), run

    straight, later = digest_after_two_more()
    state.scheduler.num_steps = 0  # Megatron's scheduler load steps *by* the saved count (a fresh scheduler's API)
    resumed_from = load_checkpoint(save, state)
    resumed, later_again = digest_after_two_more()
    result = {"pp_rank": ps.get_pipeline_model_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank(),
              "num_chunks": len(state.model), "chunks": chunks,
              "operators": sorted(str(op) for op in registry), "catalogue": sorted(str(i.op) for i in catalogue),
              "losses": [x for x in losses + later if not math.isnan(x)],
              "losses_resumed": [x for x in later_again if not math.isnan(x)],
              "eval_loss": eval_loss, "straight": straight, "resumed": resumed, "resumed_from": resumed_from}
    with open(os.path.join(out, f"result_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
