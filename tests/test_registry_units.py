"""Pure-function parts of the registry: GroupedMLP per-expert views and the catalogue merge."""

from __future__ import annotations

import pytest
import torch

from moe_ft.state.catalogue import merge_catalogue
from moe_ft.state.naming import grouped_expert_views
from moe_ft.state.operators import OperatorId, OperatorInfo

pytestmark = pytest.mark.timeout(60)


def test_grouped_views_cover_weight_once_and_share_memory():
    hidden, ffn, n = 3, 4, 2
    w1 = torch.arange(hidden * n * ffn, dtype=torch.float32).view(hidden, n * ffn)
    w2 = torch.arange(n * ffn * hidden, dtype=torch.float32).view(n * ffn, hidden)
    v1 = grouped_expert_views("mlp.experts.weight1", w1, n)
    v2 = grouped_expert_views("mlp.experts.weight2", w2, n)
    assert [tuple(v.shape) for v in v1] == [(hidden, ffn)] * n and [tuple(v.shape) for v in v2] == [(ffn, hidden)] * n
    assert torch.equal(v1[1], w1[:, ffn:]) and torch.equal(v2[1], w2[ffn:])
    assert sorted(torch.cat([v.reshape(-1) for v in v1]).tolist()) == w1.reshape(-1).tolist()
    v1[1].fill_(-1.0)  # views, not copies
    assert (w1[:, ffn:] == -1).all() and (w1[:, :ffn] >= 0).all()
    with pytest.raises(ValueError, match="weight1/weight2"):
        grouped_expert_views("mlp.experts.linear_fc1.weight", w1, n)


def test_merge_takes_largest_shard_and_round_robins_non_experts():
    e0 = OperatorId.expert_op(0, 0)
    rank0 = [OperatorInfo(op=OperatorId.embedding(), bytes_compute=10, bytes_full=30, pp_rank=0, ep_rank=0),
             OperatorInfo(op=OperatorId.dense(0), bytes_compute=5, bytes_full=9, pp_rank=0, ep_rank=0),
             OperatorInfo(op=e0, bytes_compute=4, bytes_full=8, pp_rank=0, ep_rank=0)]
    rank1 = [OperatorInfo(op=OperatorId.embedding(), bytes_compute=10, bytes_full=20, pp_rank=0, ep_rank=1),
             OperatorInfo(op=OperatorId.dense(0), bytes_compute=5, bytes_full=12, pp_rank=0, ep_rank=1),
             OperatorInfo(op=OperatorId.expert_op(0, 1), bytes_compute=4, bytes_full=8, pp_rank=0, ep_rank=1)]
    merged = {i.op: i for i in merge_catalogue([rank0, rank1], ep_size=2)}
    assert merged[OperatorId.embedding()].bytes_full == 30 and merged[OperatorId.dense(0)].bytes_full == 12
    assert {merged[OperatorId.dense(0)].ep_rank, merged[OperatorId.embedding()].ep_rank} == {0, 1}
    assert merged[OperatorId.expert_op(0, 1)].ep_rank == 1
    with pytest.raises(RuntimeError, match="several expert-parallel ranks"):
        merge_catalogue([rank0, [OperatorInfo(op=e0, bytes_compute=4, bytes_full=8, pp_rank=0, ep_rank=1)]], 2)
