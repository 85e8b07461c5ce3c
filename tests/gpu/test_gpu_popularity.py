"""Popularity counted on the GPU: the counters follow the routing tensors onto the device,
``record`` never synchronises the host, ``end_iteration`` reads back once, and the counts and routing
digests equal the CPU ones bitwise (soft counts: float sums in another order, close)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_ft.megatron_ext.router import CapacityBoost, CapacityBoostConfig
from moe_ft.popularity import ExpertPopularity, PopularityConfig

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def routing(gen, num_tokens=64, num_experts=8, topk=2):
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices
    rmap = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, idx, True)
    return rmap, torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), dim=1)


def test_device_counters_equal_cpu_counters_and_record_is_sync_free():
    gen = torch.Generator().manual_seed(3)
    cfg = dict(moe_layers=[0, 2], num_experts=8)
    cpu, gpu = ExpertPopularity(PopularityConfig(**cfg)), ExpertPopularity(PopularityConfig(**cfg))
    for it in range(4):
        for _mb in range(3):
            for layer in (0, 2):
                rmap, probs = routing(gen)
                cpu.record(layer, rmap, probs)
                dev_map, dev_probs = rmap.cuda(), probs.cuda()
                with no_host_sync():
                    gpu.record(layer, dev_map, dev_probs)
        if it == 2:  # a snapshot taken mid-iteration restores exactly on the device too
            restored = ExpertPopularity(PopularityConfig(**cfg))
            restored.load_state_dict(gpu.state_dict())
            mine, ref = restored.state_dict(), cpu.state_dict()
            assert torch.equal(mine["pending"][0], ref["pending"][0])  # hard counts; [1] is soft
            assert torch.equal(mine["routing_digest_pending"], ref["routing_digest_pending"])
        cpu.end_iteration(it)
        gpu.end_iteration(it)
        with no_host_sync():  # after end_iteration the open buffers are known zero: no device read
            state = gpu.state_dict()
        assert not state["pending"].any()
    assert gpu._pending.is_cuda and gpu.hard.device.type == "cpu"
    for name in ("hard", "since_full", "last_counts", "routing_digest"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name)), name
    assert torch.allclose(cpu.soft, gpu.soft, rtol=1e-12) and torch.allclose(cpu.ema, gpu.ema, rtol=1e-12)


def test_capacity_boost_counts_on_the_device():
    gen = torch.Generator().manual_seed(4)
    boosts = [CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[0], num_experts=8)
              for _ in range(2)]
    for b in boosts:
        b.start(torch.full((1, 8), 50.0))
    for _mb in range(4):
        rmap, _ = routing(gen)
        boosts[0].record(0, rmap, 2)
        dev_map = rmap.cuda()
        with no_host_sync():
            boosts[1].record(0, dev_map, 2)
    assert boosts[0].end_iteration(0) == boosts[1].end_iteration(0)
    assert torch.equal(boosts[0].deficit, boosts[1].deficit)
