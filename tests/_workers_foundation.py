"""torchrun worker for the foundation tests: trains with the real entry-point code path, then writes this
rank's full state (model, optimizer, scheduler, RNG) and the global digest to ``--out``.

    torchrun --nproc-per-node 4 tests/_workers_foundation.py --out DIR [--check-plain-load CKPT_DIR] <Megatron flags>
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compare_plain_megatron_load(args, ckpt_dir: str, state) -> dict:
    """Build a plain Megatron-Core GPTModel from the same config (no DDP, no moe-ft code), load the model
    part of our checkpoint with ``dist_checkpointing``, and compare it with the model we resumed."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.training.model import transformer_config, vocab_size_for

    plain = GPTModel(
        config=transformer_config(args),
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.model.num_experts,
                                                        moe_grouped_gemm=args.model.moe_grouped_gemm),
        vocab_size=vocab_size_for(args),
        max_sequence_length=args.model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )
    loaded = dist_checkpointing.load({"model": plain.sharded_state_dict()}, ckpt_dir)
    plain.load_state_dict(loaded["model"])
    ours = dict(state.model[0].module.named_parameters())
    names = [n for n, _ in plain.named_parameters()]
    equal = all(torch.equal(p, ours[n]) for n, p in plain.named_parameters())
    return {"plain_load_equal": bool(equal and set(names) == set(ours)), "plain_load_params": len(names)}


def main() -> int:
    import torch
    import torch.distributed as dist

    argv = sys.argv[1:]
    out = argv[argv.index("--out") + 1]
    del argv[argv.index("--out"): argv.index("--out") + 2]
    plain_ckpt = None
    if "--check-plain-load" in argv:
        plain_ckpt = argv[argv.index("--check-plain-load") + 1]
        del argv[argv.index("--check-plain-load"): argv.index("--check-plain-load") + 2]

    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from megatron.training.training import StepHooks
    from moe_ft.digest import global_digest, local_state_tensors

    args = parse_args(argv)
    result: dict = {}

    class Capture(StepHooks):
        def on_train_start(self, state, data, args_, start_iteration):
            self.state = state
            if plain_ckpt is not None:
                from megatron.training.checkpointing import rng_state, set_rng_state

                saved = rng_state()  # building the plain model draws from the RNGs
                result.update(_compare_plain_megatron_load(args, plain_ckpt, state))
                set_rng_state(saved)
            result["start_iteration"] = start_iteration
            return start_iteration

        def on_step_end(self, iteration, step):
            result.setdefault("losses", []).append(step.loss)
            result.setdefault("grad_norms", []).append(step.grad_norm)

        def on_train_end(self, report):
            s = self.state
            rank = dist.get_rank()
            result["digest"] = global_digest(s.model, s.optimizer, s.scheduler)
            torch.save({k: v.clone() for k, v in local_state_tensors(s.model, s.optimizer, s.scheduler).items()},
                       os.path.join(out, f"state_rank{rank}.pt"))
            result["last_iteration"] = report.last_iteration
            with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
                json.dump(result, f)

    os.makedirs(out, exist_ok=True)
    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    pretrain(args, hooks=Capture())
    return 0


if __name__ == "__main__":
    sys.exit(main())
