"""MoEtion §6 capacity boost: after a lossy recovery, stale experts take 10 % more capacity until their
lost tokens are made up (``moe_ft/megatron_ext/router.py``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

from moe_ft.megatron_ext.router import CapacityBoost, CapacityBoostConfig, per_expert_token_dropping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def routed(num_tokens=64, num_experts=4, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    # skewed: expert 0 is popular, so a capacity factor of 1 drops its tokens
    logits[:, 0] += 1.5
    top = logits.softmax(-1).topk(topk, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, top.values)
    return probs, probs > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_factors_match_megatron_dropping(seed):
    probs, rmap = routed(seed=seed)
    ref_probs, ref_map = apply_router_token_dropping(probs, rmap, router_topk=2, capacity_factor=1.0,
                                                     drop_policy="probs")
    out_probs, out_map = per_expert_token_dropping(probs, rmap, topk=2, capacity_factors=torch.ones(4))
    assert torch.equal(out_map, ref_map) and torch.equal(out_probs, ref_probs)
    assert out_map.sum(0)[0] < rmap.sum(0)[0], "the popular expert should have lost tokens"


@pytest.mark.timeout(60)
def test_boosted_expert_keeps_ten_percent_more():
    probs, rmap = routed()
    base = math.ceil(64 * 2 / 4 * 1.0)
    factors = torch.tensor([1.1, 1.0, 1.0, 1.0], dtype=torch.float64)
    _, boosted = per_expert_token_dropping(probs, rmap, topk=2, capacity_factors=factors)
    _, plain = per_expert_token_dropping(probs, rmap, topk=2, capacity_factors=torch.ones(4))
    assert int(plain.sum(0)[0]) == base
    assert int(boosted.sum(0)[0]) == min(int(rmap.sum(0)[0]), math.ceil(base * 1.1)) > base
    assert torch.equal(boosted[:, 1:], plain[:, 1:])
    # the kept tokens of the boosted expert are its highest-probability ones
    kept = probs[:, 0][boosted[:, 0]]
    dropped = probs[:, 0][rmap[:, 0] & ~boosted[:, 0]]
    assert dropped.numel() == 0 or kept.min() >= dropped.max()


@pytest.mark.timeout(60)
def test_deficit_is_paid_off_by_extra_tokens_then_boost_ends():
    boost = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[0, 1], num_experts=4)
    assert not boost.active and torch.equal(boost.capacity_factors(1), torch.ones(4, dtype=torch.float64))
    boost.start(torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 0]]))
    assert boost.active
    assert boost.capacity_factors(0).tolist() == [1.1, 1.0, 1.0, 1.0]
    assert boost.capacity_factors(1).tolist() == [1.0] * 4
    probs, rmap = routed()
    _, kept = per_expert_token_dropping(probs, rmap, topk=2, capacity_factors=boost.capacity_factors(0))
    boost.record(0, kept, topk=2)  # 32 base + 4 extra tokens for expert 0
    boost.end_iteration()
    assert boost.deficit[0].tolist() == [1.0, 0, 0, 0]
    boost.record(0, kept, topk=2)
    boost.end_iteration()
    assert not boost.active and boost.capacity_factors(0).tolist() == [1.0] * 4


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_router_subclass_applies_per_expert_capacity():
    """Megatron's router (CPU layer, single-rank gloo) in a subprocess, so the CPU layer's shims stay out
    of this pytest process."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_workers_recovery_router.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=170,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0 and "router capacity boost ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.timeout(60)
def test_made_up_iteration_state_round_trip_and_no_collective_while_inactive():
    calls = []
    boost = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[2, 3], num_experts=4,
                          all_reduce=lambda t: calls.append(t.clone()))
    assert boost.end_iteration(0) == [] and calls == []  # inactive on every rank alike: no all_reduce
    boost.start(torch.tensor([[3.0, 0, 0, 0], [0, 0, 9.0, 0]]))
    saved = boost.state_dict()
    probs, rmap = routed()
    _, kept = per_expert_token_dropping(probs, rmap, topk=2, capacity_factors=boost.capacity_factors(2))
    boost.record(2, kept, topk=2)  # 4 extra tokens for expert 0 of layer 2
    assert boost.end_iteration(7) == [(2, 0)] and len(calls) == 1
    assert boost.made_up_at.tolist() == [[7, -1, -1, -1], [-1, -1, -1, -1]] and boost.active
    restored = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[2, 3], num_experts=4)
    restored.load_state_dict(saved)  # e.g. a later recovery to a point taken before iteration 7
    assert torch.equal(restored.deficit, saved["deficit"]) and restored.made_up_at.tolist() == [[-1] * 4] * 2
    assert torch.equal(restored.owed, torch.tensor([[3.0, 0, 0, 0], [0, 0, 9.0, 0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="does not match"):
        CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[2], num_experts=4).load_state_dict(saved)
