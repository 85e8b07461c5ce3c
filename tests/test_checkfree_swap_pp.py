"""CheckFree+ with pipeline parallelism (``moe_ft/checkfree/swap_pp.py``): partners trading their layer
weights for the odd micro-batches compute exactly what the paper's out-of-order route computes.

Reference: one process, pipeline size 1, the same 4 layers run as 4 stages with the odd micro-batches in
the swapped block order (``SwapForwardStep``, the seam the convergence study uses). Under test: pipeline
size 4 on 4 gloo processes, Megatron's 1F1B schedule, the swap-capable layer spec and ``PartnerSwap``
(stages 0<->1 and 2<->3). Same weights, same micro-batches: the losses are bitwise equal, every parameter's
gradient agrees up to the order in which a partner's gradient is summed, and both differ from a run without
swap.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp

from megatron.training.extensions import LoopExtension
from tests._ft_helpers import tiny_model_flags

pytestmark = pytest.mark.multiproc

MODEL = tiny_model_flags(num_layers=4, ffn_hidden_size=64, seq_length=16, max_position_embeddings=16,
                         seed=1234)


class _SwapSpec(LoopExtension):
    def customize_layer_spec(self, spec):
        from moe_ft.checkfree.swap_pp import install_swap_layers

        return install_swap_layers(spec)


def _setup(rank: int, world: int, init: str, corpus: str, extra: list[str], swap_layers: bool):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import quiet_optional_dependency_warnings, set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from moe_ft import comm
    from moe_ft.compat import cpu as cpu_compat

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    quiet_optional_dependency_warnings()
    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    args = parse_args([*MODEL, *extra, "--data-path", corpus], world_size=world)
    ps.initialize_model_parallel(pipeline_model_parallel_size=args.parallel.pipeline_model_parallel_size)
    comm.init_coordination()
    if swap_layers:
        args.extra["checkfree_swap"] = _SwapSpec()
    set_seeds(args.training.seed)
    state = build_train_state(args)
    return args, state, build_data(args)


def _schedule(args, state, forward_step_func, batches):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in state.model:
        chunk.zero_grad_buffer()
    return get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=iter(batches),
                                       model=state.model, num_microbatches=len(batches),
                                       seq_length=args.model.seq_length, micro_batch_size=args.training.micro_batch_size,
                                       decoder_seq_length=args.model.seq_length, forward_only=False)


def _grads(gpt, name_of) -> dict[str, torch.Tensor]:
    return {name_of(n): p.main_grad.detach().clone() for n, p in gpt.named_parameters()}


def reference_worker(rank: int, init: str, corpus: str, out: str) -> None:
    from megatron.training.training import forward_step
    from moe_ft.checkfree.swap import SwapForwardStep

    args, state, data = _setup(rank, 1, init, corpus, [], swap_layers=False)
    gpt = state.model[0].module
    batches = data.batch_for_iteration(0, 0, 0)
    plain = partial(forward_step, seq_length=args.model.seq_length)
    swapped = SwapForwardStep(plain, num_stages=4, layers_per_stage=1)
    result = {"weights": {n: p.detach().clone() for n, p in gpt.named_parameters()}}
    for key, fstep in (("swap", swapped), ("plain", plain)):
        losses = _schedule(args, state, fstep, batches)
        result[key] = {"losses": [float(x["lm loss"]) for x in losses], "grads": _grads(gpt, lambda n: n)}
    assert swapped.orders_run == [(0, 1, 2, 3), (1, 0, 3, 2)] * 2
    torch.save(result, out)


def pipeline_worker(rank: int, init: str, corpus: str, ref: str, out: str) -> None:
    import re

    from megatron.core import parallel_state as ps

    from megatron.training.training import forward_step
    from moe_ft.checkfree.swap_pp import PartnerSwap

    args, state, data = _setup(rank, 4, init, corpus, ["--pipeline-model-parallel-size", "4"], swap_layers=True)
    gpt = state.model[0].module
    stage = ps.get_pipeline_model_parallel_rank()
    global_name = lambda n: re.sub(r"^decoder\.layers\.0\.", f"decoder.layers.{stage}.", n)  # noqa: E731 (1 layer/stage)
    weights = torch.load(ref)["weights"]
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(weights[global_name(name)])
    swap = PartnerSwap(state.model, pp_rank=stage, pp_ranks=list(range(4))).attach(state.config)
    assert swap.partner == {0: 1, 1: 0, 2: 3, 3: 2}[stage]
    losses = _schedule(args, state, partial(forward_step, seq_length=args.model.seq_length),
                       data.batch_for_iteration(0, 0, 0))
    assert not swap.active and swap.borrowed == []  # gradients given back in finalize_model_grads
    torch.save({"losses": [float(x["lm loss"]) for x in losses], "grads": _grads(gpt, global_name)}, out.format(stage))


def _spawn(fn, nprocs: int, args: tuple) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    while not ctx.join(timeout=300):
        pass


@pytest.mark.timeout(300)
def test_partner_swap_equals_out_of_order_route(corpus, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ref = str(tmp_path / "reference.pt")
    _spawn(reference_worker, 1, (f"file://{tmp_path}/pg_ref", corpus, ref))
    _spawn(pipeline_worker, 4, (f"file://{tmp_path}/pg_pp", corpus, ref, str(tmp_path / "stage{}.pt")))
    expected = torch.load(ref)
    got = {"grads": {}, "losses": []}
    for stage in range(4):
        part = torch.load(str(tmp_path / f"stage{stage}.pt"))
        got["grads"].update(part["grads"])
        got["losses"] += part["losses"]
    assert set(got["grads"]) == set(expected["swap"]["grads"])
    assert got["losses"] == expected["swap"]["losses"]  # the forward passes are the same computations: bitwise
    for name, grad in expected["swap"]["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # the swap changed the computation (the test would pass on a no-op otherwise)
    assert expected["swap"]["losses"] != expected["plain"]["losses"]
    moved = [n for n, g in expected["plain"]["grads"].items() if not torch.allclose(g, got["grads"][n], rtol=1e-3)]
    assert any(n.startswith("decoder.layers.") for n in moved)
