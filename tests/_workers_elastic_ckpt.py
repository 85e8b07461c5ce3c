"""torchrun worker: ``pretrain_gpt_moe.py``'s argument groups, checkpointing and training loop, dumping the
training state in a plan-independent form.

    torchrun --nproc-per-node 4 tests/_workers_elastic_ckpt.py --out DIR [--dump-at N ...] <pretrain flags>

Rank 0 writes ``DIR/losses.json`` (loss and gradient norm per trained iteration, keyed by iteration count).
Every rank writes ``DIR/state_{tag}_rank{r}.pt`` at ``tag`` = ``start`` (after ``--load``, before the first
step), ``iter{N}`` (after N iterations, before a ``--save`` at N) and ``end``: ``{name: tensor}`` for every
parameter and its Adam state (``exp_avg``, ``exp_avg_sq``, ``step``), expert tensors named by *global* expert
id -- ``L{layer}.E{expert}.{param}`` -- so standard EP and any replica plan give the same names.
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)")


def _pop(argv: list[str], flag: str, many: bool = False):
    if flag not in argv:
        return [] if many else None
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    values = argv[i + 1 : j]
    del argv[i:j]
    return values if many else values[0]


def _global_expert_ids(model) -> dict[int, list[int]]:
    """decoder layer index -> global expert id of each local expert (standard EP or elastic)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    ids = {}
    for i, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        held = getattr(experts, "held_experts", None)
        if held is None:
            assert isinstance(experts, SequentialMLP)
            offset = experts.ep_group.rank() * experts.num_local_experts
            held = [offset + j for j in range(experts.num_local_experts)]
        ids[i] = held
    return ids


def dump_state(state, path: str) -> None:
    import torch

    model = state.model[0].module
    opt_state = {}
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for param, s in opt.optimizer.state.items():
            opt_state[id(param)] = s
    ids = _global_expert_ids(model)
    out = {}
    for name, param in model.named_parameters():
        m = EXPERT.fullmatch(name)
        key = f"L{model.decoder.layers[int(m[1])].layer_number - 1}.E{ids[int(m[1])][int(m[2])]}.{m[3]}" \
            if m else name
        out[key] = param.detach().clone()
        for k, v in opt_state.get(id(param), {}).items():
            out[f"{key}#{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    torch.save(out, path)


def main() -> int:
    import torch.distributed as dist

    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from megatron.training.training import StepHooks
    from pretrain_gpt_moe import extra_argument_groups

    argv = sys.argv[1:]
    out = _pop(argv, "--out")
    dump_at = {int(x) for x in _pop(argv, "--dump-at", many=True)}
    args = parse_args(argv, extra_groups=extra_argument_groups())
    record = {"losses": {}, "grad_norms": {}}

    class Record(StepHooks):
        def on_train_start(self, state, data, args, start_iteration):
            self.state = state
            dump_state(state, os.path.join(out, f"state_start_rank{dist.get_rank()}.pt"))
            return start_iteration

        def on_step_end(self, iteration, step):
            record["losses"][iteration + 1] = step.loss
            record["grad_norms"][iteration + 1] = step.grad_norm
            if iteration + 1 in dump_at:
                dump_state(self.state, os.path.join(out, f"state_iter{iteration + 1}_rank{dist.get_rank()}.pt"))

        def on_train_end(self, report):
            dump_state(self.state, os.path.join(out, f"state_end_rank{dist.get_rank()}.pt"))
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
