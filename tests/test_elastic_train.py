"""End to end: ``pretrain_gpt_moe.py``'s training loop with ``--moe-token-dispatcher-type flexible`` and
uneven ``--ft-expert-replicas`` on 4 gloo ranks (DP=4 x EP=2, so Megatron's DDP also reduces expert
gradients over the expert-data-parallel group) against the standard alltoall dispatcher, same seed.

Iteration 1's loss is bitwise equal (same weights, bitwise-equal forward). Later losses and every gradient
norm agree to float32 round-off: the replicated experts' gradients are summed in a different order (see
``test_elastic_layer.py``), which Adam then carries forward; observed max relative loss difference ~2e-7
over 8 iterations, allowed 1e-5. A double-counted gradient would change the gradient norm by O(1).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests._ft_helpers import tiny_model_flags, torchrun

WORKER = "tests/_workers_elastic_train.py"
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, train_iters=8, log_interval=100,
                         seed=1234)


def _train(out: str, corpus: str, flags: list[str]) -> dict:
    torchrun(WORKER, ["--out", out, *MODEL, "--data-path", corpus, *flags], timeout=240)
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def test_flexible_replicated_training_matches_standard_ep(tmp_path, corpus):
    standard = _train(str(tmp_path / "standard"), corpus, [])
    flexible = _train(str(tmp_path / "flexible"), corpus, [
        "--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
        "--ft-expert-slots", "4"])
    ls, lf = standard["losses"], flexible["losses"]
    assert len(lf) == len(ls) == 8
    assert lf[-1] < lf[0] - 1.0, f"loss did not fall: {lf}"
    assert lf[0] == ls[0], "same weights and a bitwise-equal forward must give the same first loss"
    for i, (a, b) in enumerate(zip(ls, lf)):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {i + 1}: loss {b} vs standard {a}"
    for i, (a, b) in enumerate(zip(standard["grad_norms"], flexible["grad_norms"])):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {i + 1}: grad norm {b} vs standard {a}"


def test_auto_replicas_from_measured_popularity(tmp_path, corpus):
    """Run 1 (standard EP, moe-ft runtime) writes the popularity counters with --ft-trace-out; run 2 trains
    with ``--ft-expert-replicas auto --ft-expert-loads-from`` that trace: every MoE layer's plan holds the
    eq.-1 allocation of that layer's summed counts (recomputed here from the raw file), and training runs."""
    from moe_ft.placement.allocation import allocate_replicas

    trace = str(tmp_path / "trace.jsonl")
    torchrun("pretrain_gpt_moe.py", [*MODEL, "--data-path", corpus, "--train-iters", "3", "--ft",
                                     "--ft-policy", "sparse", "--ft-replicas", "0", "--ft-store-dir",
                                     str(tmp_path / "store"), "--ft-trace-out", trace], timeout=240)
    with open(trace) as f:
        lines = [json.loads(line) for line in f]
    assert [line["iteration"] for line in lines] == [0, 1, 2]
    # sparse aggregates popularity over all ranks: 8 samples x 64 tokens x top-2 per layer and iteration
    assert all(sum(row) == 8 * 64 * 2 for line in lines for row in line["counts"])
    loads = [[sum(line["counts"][layer][e] for line in lines) for e in range(4)] for layer in range(2)]

    run = _train(str(tmp_path / "auto"), corpus, ["--moe-token-dispatcher-type", "flexible",
                                                   "--ft-expert-replicas", "auto", "--ft-expert-loads-from",
                                                   trace, "--ft-expert-slots", "4"])
    assert sorted(run["plans"]) == ["0", "1"]
    for layer in range(2):
        replicas = run["plans"][str(layer)]  # R[e, j]
        expected = allocate_replicas(loads[layer], num_nodes=2, slots_per_node=4, min_replicas=1)
        assert [sum(row) for row in replicas] == expected, (layer, loads[layer])
        assert [sum(col) for col in zip(*replicas)] == [4, 4]
    losses = run["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 1.0, losses
