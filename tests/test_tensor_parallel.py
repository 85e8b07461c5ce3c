"""Tensor, sequence and expert-tensor parallelism on CPU with gloo.

The flag checks say which combinations Megatron-Core 0.16.1 trains; the CPU layer's uneven tensor-parallel
collectives equal their definition; a TP2 x EP2 job with sequence parallelism trains with a falling loss;
and a kill under ``moe-ft launch`` ends bitwise equal to the fault-free run, both with TP x EP (global
replay) and with TP x PP (localized: the failed stage's whole tensor-parallel group replays).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import ArgumentError, parse_args  # noqa: E402
from moe_ft.cli.drill import run_job  # noqa: E402
from tests._ft_helpers import torchrun  # noqa: E402


@pytest.mark.parametrize("flags,world,message", [
    (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-attention-heads", "3", "--hidden-size", "48"],
     2, "--num-attention-heads 3 must be divisible by --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63"], 2,
     "--seq-length 63 must be divisible"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"], 2,
     "ranks per stage must be divisible by --expert-model-parallel-size 2 x expert tensor-parallel size 2"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "flexible"], 2,
     "flexible dispatcher (replicated experts) does not cover tensor parallelism"),
    (["--expert-tensor-parallel-size", "0"], 2, "--expert-tensor-parallel-size must be positive"),
    (["--expert-tensor-parallel-size", "3"], 3, "--ffn-hidden-size 256 must be divisible by the expert tensor-parallel size 3"),
])
def test_tensor_parallel_flags_are_checked(flags, world, message, data_prefix):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(["--data-path", data_prefix, *flags], world_size=world)


def test_tensor_parallel_layouts_megatron_trains_are_accepted(data_prefix):
    args = parse_args(["--data-path", data_prefix, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2 and args.parallel.sequence_parallel
    args = parse_args(["--data-path", data_prefix, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"], world_size=4)
    assert args.parallel.expert_tensor_parallel_size == 1  # experts not tensor-parallel: EP over all 4 ranks


def _uneven_collectives(rank: int, world: int, init: str, out: dict) -> None:
    from megatron.core.tensor_parallel import mappings

    from moe_ft.compat.cpu import activate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    activate(force=True)
    group = dist.new_group([0, 1])
    splits = [3, 5]
    mine = torch.arange(splits[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=splits)
    whole = torch.arange(16, dtype=torch.float32).reshape(8, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(whole, group, input_split_sizes=splits)
    even = mappings._gather_along_first_dim(torch.full((2, 2), float(rank)), group)  # Megatron-Core's own path
    out[rank] = (gathered, scattered, even)
    dist.destroy_process_group()


def test_uneven_tensor_parallel_collectives_on_gloo(tmp_path):
    """The CPU layer's uneven gather and reduce-scatter (what the alltoall dispatcher does over the
    tensor-parallel group) equal their definitions; the even gather stays Megatron-Core's."""
    init = f"file://{tmp_path / 'rdzv'}"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_uneven_collectives, args=(2, init, out), nprocs=2, join=True)
        results = dict(out)
    parts = [torch.arange(n * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r, n in enumerate([3, 5])]
    total = torch.arange(16, dtype=torch.float32).reshape(8, 2) * 3
    for rank, (gathered, scattered, even) in results.items():
        assert torch.equal(gathered, torch.cat(parts))
        assert torch.equal(scattered, torch.split(total, [3, 5])[rank])
        assert torch.equal(even, torch.tensor([[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 2))


@pytest.mark.multiproc
def test_tp2ep2_with_sequence_parallel_trains(corpus):
    from moe_ft.cli.drill import LAYOUTS, TINY

    argv = [*TINY, *LAYOUTS["tp2ep2"], "--train-iters", "20", "--log-interval", "1", "--data-path", corpus]
    out = torchrun("pretrain_gpt_moe.py", argv, nproc=4).stdout
    assert "world 4 | TP 2 SP | PP 1 | VP 1 | EP 2 | DP 2" in out, out[-2000:]
    losses = [float(m) for m in re.findall(r"iteration +\d+/20 \| loss ([0-9.]+)", out)]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    print(f"tp2ep2 + SP: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


ITERS = 12


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout,faults,scope,extra", [
    ("tp2ep2", ["1:7"], "global", ["--use-distributed-optimizer"]),
    ("tp2pp2", ["3:9:backward"], "localized", ["--expert-tensor-parallel-size", "1"]),
], ids=["tp2ep2-distributed-optimizer", "tp2pp2-etp1-localized"])
def test_kill_under_tensor_parallelism_ends_bitwise(layout, faults, scope, extra, corpus, tmp_path, fault_free_digest):
    """TP x EP with the distributed optimizer (its shards are per TP x DP rank), and TP x PP with experts that
    are not tensor-parallel (ETP 1 != TP 2) under localized recovery."""
    res = run_job(job=f"{layout}_kill", workdir=str(tmp_path), faults=faults, max_restarts=2, timeout=400,
                  layout=layout, policy="sparse", iters=ITERS, data=corpus, store=str(tmp_path / "store"), window=3,
                  scope=scope, extra=extra)
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest(layout, ITERS, extra=tuple(extra))
    (report,) = res["reports"]
    assert report["restart_kind"] == "inprocess" and report["token_loss"]["tokens"] == 0.0
    assert report["scope"]["mode"] == scope
    if scope == "localized":  # the failed stage's whole tensor-parallel group replays, fed by the logs
        assert report["scope"]["failed_stages"] == [1] and report["scope"]["replaying"] == [2, 3]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_tp2_checkpoint_loads_at_tp1_with_the_same_loss(corpus, tmp_path):
    """A TP2 x EP2 ``--save`` checkpoint (iteration 4) loads at TP1 x EP2: dist_checkpointing reshards the
    model and the optimizer, and iterations 5-6 log the TP2 run's losses (4 decimals). The padded vocabulary depends on
    TP (--make-vocab-size-divisible-by x TP) and its padded rows enter the softmax: loading with another
    padded size is refused with the flag to pass."""
    from moe_ft.cli.drill import LAYOUTS, TINY

    def losses(out: str) -> dict[int, float]:
        return {int(i): float(v) for i, v in re.findall(r"iteration +(\d+)/6 \| loss ([0-9.]+)", out)}

    base = [*TINY, "--log-interval", "1", "--train-iters", "6", "--data-path", corpus]
    tp2 = torchrun("pretrain_gpt_moe.py", [*base, *LAYOUTS["tp2ep2"], "--save", str(tmp_path / "tp2"),
                                           "--save-interval", "4"], nproc=4).stdout
    (tmp_path / "tp2" / "latest_checkpointed_iteration.txt").write_text("4")  # resume from iteration 4
    tp1_flags = [*base, "--expert-model-parallel-size", "2", "--load", str(tmp_path / "tp2")]
    refused = torchrun("pretrain_gpt_moe.py", tp1_flags, nproc=2, check=False)
    assert refused.returncode != 0
    assert "saved with a vocabulary padded to 512 rows, this model pads it to 384" in refused.stdout + refused.stderr
    tp1 = torchrun("pretrain_gpt_moe.py", [*tp1_flags, "--make-vocab-size-divisible-by", "256"], nproc=2).stdout
    assert "resumed from" in tp1 and "at iteration 4" in tp1
    want, got = losses(tp2), losses(tp1)
    assert set(got) == {5, 6}
    assert got == {it: want[it] for it in (5, 6)}  # equal in the 4 decimals the log line prints
    # another expert-parallel size: Megatron-Core's optimizer state (one optimizer per parameter set, its keys
    # named after the set) does not map; the error says so and names --no-load-optim, which loads the model
    ep1 = [*base, "--make-vocab-size-divisible-by", "256", "--load", str(tmp_path / "tp2")]
    refused = torchrun("pretrain_gpt_moe.py", ep1, nproc=2, check=False)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "CheckpointError: cannot load" in out
    assert "pass --no-load-optim to load the model alone" in out
    model_only = torchrun("pretrain_gpt_moe.py", [*ep1, "--no-load-optim"], nproc=2).stdout
    assert "resumed from" in model_only and "at iteration 4" in model_only
    assert losses(model_only)[5] == want[5]  # the same weights; Adam's moments start again from zero
