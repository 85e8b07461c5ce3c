"""Megatron-Core MoE GPT training on CPU with gloo, through the real entry-point code, 4 real processes.

Scenario A (EP=2 x PP=2, 1F1B, alltoall dispatcher, plain optimizer) and scenario B (DP=2 x EP=2,
allgather and alltoall dispatchers, distributed optimizer) each check: the loss falls, two runs with the
same seed are bitwise identical, resuming from a ``--save`` checkpoint at iteration 3 and training to 6
equals the uninterrupted run bitwise (model, optimizer, scheduler, RNG), and the model part of our
checkpoint loads into a plain Megatron-Core ``GPTModel`` built from the same config.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests._ft_helpers import tiny_model_flags, torchrun

WORKER = "tests/_workers_foundation.py"
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

MODEL = tiny_model_flags(hidden_size=64, seq_length=64, log_interval=3, lr="3e-3", seed=1234)


def run_worker(out: str, flags: list[str], nproc: int = 4) -> list[dict]:
    torchrun(WORKER, ["--out", out, *flags], nproc=nproc, timeout=400)
    results = []
    for rank in range(nproc):
        with open(os.path.join(out, f"result_rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def states(out: str, nproc: int = 4) -> list[dict]:
    return [torch.load(os.path.join(out, f"state_rank{r}.pt")) for r in range(nproc)]


def assert_states_bitwise_equal(out_a: str, out_b: str) -> None:
    for rank, (a, b) in enumerate(zip(states(out_a), states(out_b))):
        assert a.keys() == b.keys(), f"rank {rank}: different state keys"
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"rank {rank}: not bitwise equal: {diff[:5]}"


def resume_dir(src_ckpt: str, dst: str, iteration: int) -> str:
    """A --load directory holding only iteration ``iteration`` of ``src_ckpt``."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(src_ckpt, name), os.path.join(dst, name))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dst


def last_stage_losses(results: list[dict]) -> list[float]:
    for r in results:
        if r.get("losses") and not any(math.isnan(x) for x in r["losses"]):
            return r["losses"]
    raise AssertionError("no rank reported losses")


def _scenario(tmp_path, corpus, layout: list[str], label: str):
    flags = [*MODEL, *layout, "--data-path", corpus, "--train-iters", "6"]
    full, again, resumed = (str(tmp_path / f"{label}_{n}") for n in ("full", "again", "resumed"))
    ckpt = os.path.join(full, "ckpt")
    res_full = run_worker(full, [*flags, "--save", ckpt, "--save-interval", "3"])
    losses = last_stage_losses(res_full)
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses}"
    assert all(r["last_iteration"] == 6 for r in res_full)
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]

    res_again = run_worker(again, flags)
    assert res_again[0]["digest"] == res_full[0]["digest"], "two runs with the same seed differ"
    assert_states_bitwise_equal(full, again)

    load = resume_dir(ckpt, str(tmp_path / f"{label}_load"), 3)
    res_resumed = run_worker(resumed, [*flags, "--load", load, "--check-plain-load",
                                       os.path.join(load, "iter_0000003")])
    assert all(r["start_iteration"] == 3 for r in res_resumed)
    assert all(r["plain_load_equal"] and r["plain_load_params"] > 0 for r in res_resumed)
    assert res_resumed[0]["digest"] == res_full[0]["digest"], "resume is not bitwise equal to the full run"
    assert_states_bitwise_equal(full, resumed)
    assert last_stage_losses(res_resumed) == losses[3:]
    return res_full


def test_ep2_pp2_alltoall_plain_optimizer(tmp_path, corpus):
    _scenario(tmp_path, corpus, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--moe-token-dispatcher-type", "alltoall"], "ep2pp2")


def test_dp2_ep2_distributed_optimizer_and_dispatchers(tmp_path, corpus):
    layout = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    res_allgather = _scenario(tmp_path, corpus, [*layout, "--moe-token-dispatcher-type", "allgather"], "dp2ep2")
    res_alltoall = run_worker(str(tmp_path / "alltoall"), [*MODEL, *layout, "--moe-token-dispatcher-type",
                                                          "alltoall", "--data-path", corpus, "--train-iters", "6"])
    # Same tokens reach the same experts; only the order of the final weighted sums differs.
    torch.testing.assert_close(torch.tensor(last_stage_losses(res_alltoall)),
                               torch.tensor(last_stage_losses(res_allgather)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(res_alltoall[0]["grad_norms"]),
                               torch.tensor(res_allgather[0]["grad_norms"]), rtol=1e-4, atol=1e-6)
