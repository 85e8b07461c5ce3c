"""Checkpoints of replicated experts (``ElasticExperts.sharded_state_dict``): Megatron ``dist_checkpointing``
with standard EP's layout, so a checkpoint moves between replica plans and standard EP in both directions.

Five ``pretrain_gpt_moe.py`` runs on 4 gloo ranks (DP=4 x EP=2, plain optimizer; ``--save``/``--load``):

    A   flexible plan A (replicas 3 1 2 2, 4 slots): 6 iterations, saves after 2 (and 4, 6)
    A2  plan A, --load A@2   -> iterations 3-4   (same plan: the same math)
    B   plan B (replicas 1 2 2 1, 3 slots, spread), --load A@2 -> iterations 3-4
    S   standard alltoall EP, --load A@2 -> iterations 3-4, saves after 4
    B2  plan B, --load S@4 (standard -> flexible) -> iterations 5-6

Exact (bitwise): after every load, every parameter and its Adam state (exp_avg, exp_avg_sq, step), named by
global expert id, equals the saved run's state, on every holder of every expert; A2's losses and gradient
norms equal A's (same plan, same summation order); the first loss after a load into another plan or
standard EP equals A's (same weights, and the flexible forward is bitwise equal to standard EP's).
Tolerance: later losses and gradient norms under another plan differ by float32 round-off, because a
replicated expert's gradient is summed in another order (``test_elastic_train.py``); allowed 1e-5
relative (observed: losses equal, gradient norms ~1e-9 relative).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests._ft_helpers import tiny_model_flags, torchrun

WORKER = "tests/_workers_elastic_ckpt.py"
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, log_interval=100, seed=1234)
PLAN_A = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
          "--ft-expert-slots", "4"]
PLAN_B = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "1", "2", "2", "1",
          "--ft-expert-slots", "3", "--ft-placement", "spread"]


def _checkpoint_at(root: str, iteration: int, tmp) -> str:
    """A --load directory whose newest checkpoint is ``root``'s iteration ``iteration``."""
    path = tmp / f"{os.path.basename(root)}_at{iteration}"
    path.mkdir()
    name = f"iter_{iteration:07d}"
    os.symlink(os.path.join(root, name), path / name)
    (path / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return str(path)


def _state(out: str, tag: str) -> dict:
    """Union of the ranks' dumps; a name dumped by several ranks (DP replicas, expert holders) must agree."""
    merged = {}
    for rank in range(4):
        for name, value in torch.load(os.path.join(out, f"state_{tag}_rank{rank}.pt")).items():
            if name in merged:
                assert torch.equal(merged[name], value), f"{out} {tag}: copies of {name} differ (rank {rank})"
            merged[name] = value
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("elastic_ckpt")

    def run(name, flags, iters, *extra):
        out = str(tmp / name)
        torchrun(WORKER, ["--out", out, *MODEL, "--data-path", corpus, "--train-iters", str(iters), *flags,
                          *extra], timeout=300)
        with open(os.path.join(out, "losses.json")) as f:
            record = json.load(f)
        return {"out": out, **{k: {int(i): v for i, v in d.items()} for k, d in record.items()}}

    ck_a, ck_s = str(tmp / "ck_a"), str(tmp / "ck_s")
    result = {"A": run("A", PLAN_A, 6, "--save", ck_a, "--save-interval", "2", "--dump-at", "2")}
    a2 = _checkpoint_at(ck_a, 2, tmp)
    # shorter runs from A's checkpoint keep A's LR schedule (decay over 6 iterations)
    keep = "--use-checkpoint-opt-param-scheduler"
    result["A2"] = run("A2", PLAN_A, 4, "--load", a2, keep)
    result["B"] = run("B", PLAN_B, 4, "--load", a2, keep)
    result["S"] = run("S", [], 4, "--load", a2, "--save", ck_s, keep)
    result["B2"] = run("B2", PLAN_B, 6, "--load", ck_s)
    return result


def test_flexible_checkpoint_has_standard_ep_layout(runs):
    """Same sharded keys and global shapes as the checkpoint standard EP wrote (model and Adam state)."""
    from megatron.core import dist_checkpointing

    root = os.path.dirname(runs["A"]["out"])
    flexible = dist_checkpointing.load_tensors_metadata(os.path.join(root, "ck_a", "iter_0000002"))
    standard = dist_checkpointing.load_tensors_metadata(os.path.join(root, "ck_s", "iter_0000004"))
    shapes = lambda meta: {k: tuple(v.global_shape) for k, v in meta.items()}  # noqa: E731
    assert shapes(flexible) == shapes(standard)
    # one tensor per expert weight, expert id on axis 1 (axis 0: layer), as SequentialMLP writes it
    assert shapes(flexible)["decoder.layers.mlp.experts.experts.linear_fc1.weight"][:2] == (2, 4)
    assert any(k.endswith("exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc2.weight") for k in flexible)


@pytest.mark.parametrize("name, source, tag", [("A2", "A", "iter2"), ("B", "A", "iter2"), ("S", "A", "iter2"),
                                               ("B2", "S", "end")])
def test_loaded_state_bitwise_equal(runs, name, source, tag):
    saved, loaded = _state(runs[source]["out"], tag), _state(runs[name]["out"], "start")
    assert saved.keys() == loaded.keys()
    assert any(k.endswith("#exp_avg_sq") and ".E" in k for k in saved), "no expert optimizer state compared"
    differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not differ, f"{name} loaded from {source}: {differ[:8]}"


def test_same_plan_resume_is_bitwise(runs):
    a, a2 = runs["A"], runs["A2"]
    assert sorted(a2["losses"]) == [3, 4]
    for it in (3, 4):
        assert a2["losses"][it] == a["losses"][it] and a2["grad_norms"][it] == a["grad_norms"][it], it


@pytest.mark.parametrize("name, first", [("B", 3), ("S", 3), ("B2", 5)])
def test_other_plan_resume_matches(runs, name, first):
    a, run = runs["A"], runs[name]
    if name != "B2":  # loaded A's own state: the first forward is bitwise A's
        assert run["losses"][first] == a["losses"][first]
    for it, loss in run["losses"].items():
        assert abs(loss - a["losses"][it]) <= 1e-5 * abs(a["losses"][it]), (name, it)
        assert abs(run["grad_norms"][it] - a["grad_norms"][it]) <= 1e-5 * a["grad_norms"][it], (name, it)
    losses = [run["losses"][i] for i in sorted(run["losses"])]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < a["losses"][1]
