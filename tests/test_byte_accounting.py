"""Bytes are charged where they are copied. The snapshot engine of every rank copies each
operator of the plan that its registry holds: an expert on its EP rank, a non-expert on *every* EP rank of
its stage (its replica, or its distributed-optimizer shard). The catalogue's ``copies`` and
:func:`copied_bytes` must say the same: for every policy's plans, the bytes charged to each rank key
``(pp_rank, ep_rank)`` equal what the fullest rank of that key really copied, on the real Megatron model
(one torchrun launch: EP=2 x PP=2, DP=2 x EP=2, DP=2 x EP=2 with the distributed optimizer)."""

from __future__ import annotations

import json
import os

import pytest

from moe_ft.state.catalogue import CatalogueInfo, copied_bytes, copied_bytes_per_rank, merge_catalogue
from moe_ft.state.operators import Level, OperatorId, OperatorInfo
from tests._ft_helpers import torchrun

LAYOUTS = ["--expert-model-parallel-size 2 --pipeline-model-parallel-size 2",
           "--expert-model-parallel-size 2",
           "--expert-model-parallel-size 2 --use-distributed-optimizer"]


def test_merge_charges_non_experts_to_every_ep_rank_of_the_stage():
    e0, e1, d0, emb = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1), OperatorId.dense(0), OperatorId.embedding()
    info = lambda op, c, f, ep: OperatorInfo(op=op, bytes_compute=c, bytes_full=f, pp_rank=0, ep_rank=ep)  # noqa: E731
    # ranks 0, 2 are EP rank 0 (DP index 0, 1), ranks 1, 3 EP rank 1; distributed-optimizer shards differ
    per_rank = [[info(emb, 10, 30, 0), info(d0, 5, 9, 0), info(e0, 4, 8, 0)],
                [info(emb, 10, 20, 1), info(d0, 5, 12, 1), info(e1, 4, 8, 1)],
                [info(emb, 10, 25, 0), info(d0, 5, 11, 0), info(e0, 4, 8, 0)],
                [info(emb, 10, 22, 1), info(d0, 5, 7, 1), info(e1, 4, 8, 1)]]
    merged = merge_catalogue(per_rank, ep_size=2)
    assert all(isinstance(i, CatalogueInfo) for i in merged)
    by_op = {i.op: i for i in merged}
    assert by_op[emb].copies == ((0, 0, 0, 10, 30), (1, 0, 1, 10, 20), (2, 0, 0, 10, 25), (3, 0, 1, 10, 22))
    assert by_op[e0].copies == ((0, 0, 0, 4, 8), (2, 0, 0, 4, 8)) and by_op[e1].copies == ((1, 0, 1, 4, 8), (3, 0, 1, 4, 8))
    plan = {emb: Level.FULL, d0: Level.FULL, e0: Level.FULL, e1: Level.NONE}
    per_rank = {rank: b for (rank, _), b in copied_bytes_per_rank(plan, merged).items()}
    assert per_rank == {0: 30 + 9 + 8, 1: 20 + 12, 2: 25 + 11 + 8, 3: 22 + 7}
    # per key: the fullest rank's total (a budget must fit it), not the sum of per-operator maxima
    # (30 + 11 + 8 = 49 for key (0, 0): no rank copies that much)
    assert copied_bytes(plan, merged) == {(0, 0): 47, (0, 1): 32}
    assert copied_bytes({emb: Level.COMPUTE, d0: Level.NONE, e0: Level.NONE, e1: Level.COMPUTE}, merged) == \
        {(0, 0): 10, (0, 1): 14}
    # a hand-built catalogue of plain OperatorInfo (policy unit tests) keeps one key per operator
    assert copied_bytes(plan, [info(emb, 10, 30, 1), info(d0, 5, 9, 0), info(e0, 4, 8, 0), info(e1, 4, 8, 1)]) == \
        {(0, 0): 9 + 8, (0, 1): 30}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_charged_bytes_equal_what_each_rank_copies(tmp_path, corpus):
    args = ["--out", str(tmp_path), "--data-path", corpus]
    for layout in LAYOUTS:
        args += ["--layout", layout]
    torchrun("tests/_workers_accounting.py", args, timeout=280)
    ranks = [json.load(open(os.path.join(tmp_path, f"result_rank{r}.json"))) for r in range(4)]
    for idx, layout in enumerate(LAYOUTS):
        rows = [r[idx] for r in ranks]  # rows[rank][k]: the same (policy, iteration) at index k on every rank
        under_counted = 0
        for k in range(len(rows[0])):
            case = [rows[rank][k] for rank in range(4)]
            what = f"{layout}: {case[0]['policy']} iteration {case[0]['iteration']}"
            charged = case[0]["charged"]
            assert all(c["charged"] == charged for c in case), what  # every rank derives the same accounting
            copied: dict[str, list[int]] = {}
            for c in case:
                copied.setdefault(",".join(map(str, c["key"])), []).append(c["engine_bytes"])
            assert set(charged) == set(copied), what
            for rank, c in enumerate(case):  # each rank: charged == what its engine copied == the registry's count
                assert c["charged_rank"] == c["engine_bytes"] == c["registry_bytes"], f"{what} rank {rank}"
            for key, engine_bytes in copied.items():
                assert charged[key] == max(engine_bytes), f"{what} key {key}: charged {charged[key]}, copied {engine_bytes}"
                if "distributed" not in layout:  # replicas copy the same bytes; shards may differ
                    assert len(set(engine_bytes)) == 1, what
            under_counted += any(c["home_bytes"] < c["engine_bytes"] for c in case)
        # charging each non-expert to one "home" EP rank (the old accounting) misses what the others copy
        assert under_counted > 0, layout


def test_policies_charge_non_experts_on_every_holder():
    """``bytes_per_rank`` (every policy's plan accounting) and the selective policy's non-expert floor use
    the bytes each rank key really copies: a non-expert held on both EP ranks is charged to both."""
    from moe_ft.policy.base import bytes_per_rank
    from moe_ft.policy.selective import SelectiveConfig, SelectivePolicy

    emb, d0 = OperatorId.embedding(), OperatorId.dense(0)
    e0, e1 = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)
    info = lambda op, c, f, ep: OperatorInfo(op=op, bytes_compute=c, bytes_full=f, pp_rank=0, ep_rank=ep)  # noqa: E731
    merged = merge_catalogue([[info(emb, 10, 30, 0), info(d0, 5, 9, 0), info(e0, 4, 8, 0)],
                              [info(emb, 10, 20, 1), info(d0, 5, 12, 1), info(e1, 4, 8, 1)]], ep_size=2)
    plan = {emb: Level.FULL, d0: Level.FULL, e0: Level.NONE, e1: Level.FULL}
    assert bytes_per_rank(plan, {i.op: i for i in merged}) == {(0, 0): 39, (0, 1): 40}
    policy = SelectivePolicy(SelectiveConfig(local_budget=100, remote_budget=100), merged)
    assert policy._non_expert_bytes == {(0, 0): 39, (0, 1): 32}
    with pytest.raises(ValueError, match=r"below the 39 bytes of non-expert FULL state on rank \(pp=0, ep=0\)"):
        SelectivePolicy(SelectiveConfig(local_budget=35, remote_budget=100), merged)


def test_replication_bandwidth_sets_b_remote_from_the_agreed_iteration_time():
    """``--ft-replication-bandwidth``: ``B_remote = BW x T_iter`` with ``T_iter`` read when asked (the
    clock's newest agreement), the build-time measurement before the first one; no flag: unlimited."""
    from types import SimpleNamespace

    from moe_ft.config import FTConfig

    clock = SimpleNamespace(t_iter_s=None)
    ctx = SimpleNamespace(clock=clock, t_iter_s=0.5)
    assert FTConfig.from_flags(ft=True).replication.remote_budget(ctx) is None
    budget = FTConfig.from_flags(ft=True, ft_replication_bandwidth=1e6).replication.remote_budget(ctx)
    assert budget() == 500_000
    clock.t_iter_s = 0.25
    assert budget() == 250_000
    with pytest.raises(ValueError, match="--ft-replication-bandwidth must be >= 0"):
        FTConfig.from_flags(ft=True, ft_replication_bandwidth=-1.0)
