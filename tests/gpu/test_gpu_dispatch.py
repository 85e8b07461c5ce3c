"""Triton dispatch permutation on CUDA: bitwise equal to the PyTorch reference, and its
rate next to a device-to-device copy of the same bytes and Megatron's ``moe_utils.permute`` (recorded)."""

from __future__ import annotations

import pytest

from tests.gpu._results import record
from tools.bench.gpu_dispatch import bench

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("tokens,hidden,topk,experts,world", [(4096, 1024, 2, 8, 4), (16384, 4096, 8, 64, 8)])
def test_triton_permute_on_cuda(tokens, hidden, topk, experts, world):
    res = bench(tokens=tokens, hidden=hidden, topk=topk, experts=experts, world=world, iters=10)
    record(f"dispatch_{tokens}x{hidden}_top{topk}_e{experts}_w{world}", res)
    assert res["equal"], res
    assert all(v > 0 for v in res["gbps"].values()), res
