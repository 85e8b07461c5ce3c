"""The elastic MoE layer (flexible dispatcher + replicated experts) equals Megatron's standard EP layer.

One 4-process gloo run (``tests/_workers_elastic_layer.py``) covers EP=4 and EP=2 (two EP groups), the
standard layout and random uneven replica plans from every placement strategy (including ranks with several
slots of one expert and experts away from their standard-EP home rank), with balanced and skewed routing.

Tolerances: replica weights, the forward output, the input gradient and the router gradient must be
bitwise equal (every token meets the same expert weights in a GEMM with the same inner dimension, probs are
applied inside the expert as Megatron does, and with top-2 the combine adds two terms, which is
commutative). An expert's weight gradient is a sum over its tokens: standard EP forms it in one GEMM on the
owner, the elastic layer as partial GEMMs on each holder plus an all-reduce, a different summation order,
so it is compared with ``atol = 1e-6 * max(1, max|grad|)`` (float32; observed differences ~1e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "_workers_elastic_layer.py")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic_layer"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "moe_ft.drills.prelaunch", "--standalone", "--nproc-per-node=4", WORKER, "--out", out]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=220)
    if proc.returncode != 0:
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    per_rank = []
    for rank in range(4):
        with open(os.path.join(out, f"result_rank{rank}.json")) as f:
            per_rank.append(json.load(f))
    cases = [(rank, case) for rank, rank_cases in enumerate(per_rank) for case in rank_cases]
    assert cases, "the worker wrote no case"
    return cases


def test_plans_cover_uneven_and_stacked_replicas(cases):
    replicas = [case["replicas"] for _, case in cases]
    assert any(len(set(sum(r, []))) > 2 for r in replicas), "no uneven replica counts"
    assert any(max(max(row) for row in r) > 1 for r in replicas), "no rank with several slots of one expert"
    assert any(case["skew"] for _, case in cases) and any(not case["skew"] for _, case in cases)
    assert {case["ep"] for _, case in cases} == {2, 4}


def test_replica_weights_equal_standard_experts(cases):
    assert all(case["weights_equal"] for _, case in cases)


def test_forward_and_input_router_gradients_bitwise(cases):
    for rank, case in cases:
        where = f"rank {rank} ep {case['ep']} plan {case['plan']} skew {case['skew']}"
        assert case["out_bitwise"], f"{where}: output differs by {case['out_diff']}"
        assert case["input_grad_bitwise"], f"{where}: input gradient differs by {case['input_grad_diff']}"
        assert case["router_grad_bitwise"], f"{where}: router gradient differs by {case['router_grad_diff']}"


def test_expert_gradients_summed_over_holders(cases):
    for rank, case in cases:
        tol = 1e-6 * max(1.0, case["expert_grad_scale"])
        assert case["expert_grad_diff"] <= tol, (
            f"rank {rank} ep {case['ep']} plan {case['plan']}: replica gradient differs from the standard "
            f"owner's by {case['expert_grad_diff']} (> {tol})")
