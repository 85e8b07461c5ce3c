"""``--ft`` with the flexible dispatcher and replicated experts (Lazarus §4.1).

Local expert ``j`` of an ``ElasticMoELayer`` is ``held_experts[j]``, not standard EP's
``local_expert_indices[j]`` (that mapping named wrong operators, or raised ``IndexError`` when a rank holds
more distinct experts than ``E / EP``). A replicated expert is one operator held by several EP ranks: the
catalogue lists it under its first holder, and every holder snapshots its replica.

* unit: the operator names of a real elastic layer's parameters, and the catalogue merge of replicated
  experts (pure);
* drill (2 simulated nodes x 2 ranks, DP2 x EP2, distributed optimizer, replicas 3 1 2 2 on 4 slots per EP
  rank, sparse window 3): node 1 lost at iteration 6 and replaced; its ranks fetch their entries from peers
  on node 0; the job ends **bitwise** equal to the fault-free run; every holder's store holds its replicas.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_ft.elastic.holders import home_ep_rank, with_home_ep_ranks
from moe_ft.state.catalogue import merge_catalogue
from moe_ft.state.operators import OperatorId, OperatorInfo

FLEXIBLE = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
            "--ft-expert-slots", "4"]


def test_replicated_experts_get_one_home_in_the_catalogue():
    # R[e, j]: expert 0 on both EP ranks (2 + 1 slots), 1 and 3 on rank 1 only, 2 on rank 0 only
    replicas = torch.tensor([[2, 1], [0, 1], [2, 0], [0, 2]])
    held = {j: (replicas[:, j] > 0).nonzero().flatten().tolist() for j in range(2)}
    assert held == {0: [0, 2], 1: [0, 1, 3]}
    per_rank = []
    for ep in range(2):
        infos = [OperatorInfo(op=OperatorId.dense(0), bytes_compute=8, bytes_full=24, ep_rank=ep)]
        infos += [OperatorInfo(op=OperatorId.expert_op(0, e), bytes_compute=4, bytes_full=12, ep_rank=ep)
                  for e in held[ep]]
        per_rank.append(infos)
    with pytest.raises(RuntimeError, match="several expert-parallel ranks"):
        merge_catalogue(per_rank, ep_size=2)  # what the runtime did before: replicated experts refused
    merged = merge_catalogue([with_home_ep_ranks(infos, {0: replicas}) for infos in per_rank], ep_size=2)
    homes = {i.op.expert: i.ep_rank for i in merged if i.op.is_expert}
    assert homes == {0: 0, 1: 1, 2: 0, 3: 1}
    (e0,) = [i for i in merged if i.op == OperatorId.expert_op(0, 0)]
    assert [rank for rank, *_ in e0.copies] == [0, 1], "every holder copies its replica"
    assert home_ep_rank(replicas, 3) == 1
    with pytest.raises(ValueError, match="no replica"):
        home_ep_rank(torch.zeros(2, 2, dtype=torch.int64), 0)


def _operators_in_store(root: str, job: str, rank: int) -> set[OperatorId]:
    from moe_ft.store.store import StoreConfig

    catalog = StoreConfig(root=root, job_id=job, rank=rank).build().catalog()
    return {op for point in catalog.points() for op in point.entries}


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_node_loss_with_replicated_experts_recovers_bitwise(corpus, tmp_path):
    from moe_ft.cli.drill import node_flags, run_job, run_node_job
    from moe_ft.drills.cluster import NodeLoss

    iters, window = 10, 3
    common = dict(layout="dp2ep2", policy="sparse", iters=iters, data=corpus, window=window)
    ref = run_job(job="ref", workdir=str(tmp_path), timeout=300, store=str(tmp_path / "ref_store"),
                  extra=["--ft-replicas", "1", "--ft-ranks-per-node", "2", *FLEXIBLE], **common)
    assert ref["rc"] == 0 and ref["digest"], f"fault-free run failed, see {ref['log']}"

    losses = [NodeLoss.parse("1:6")]
    extra = node_flags(nodes=2, losses=losses, faults=[], work=str(tmp_path), window=window) + FLEXIBLE
    store = str(tmp_path / "store")
    res = run_node_job(job="faulty", workdir=str(tmp_path), faults=[], losses=losses, num_nodes=2, max_restarts=2,
                       timeout=400, store=store, extra=extra, **common)
    assert res["rc"] == 0, f"node drill failed (rc {res['rc']}), see {res['logs']}"
    (report,) = res["reports"]
    assert report["recovery_point"]["source"] == "memory"
    assert sorted(report["recovery_point"]["fetched"]) == ["2", "3"], "node 1's ranks fetch from node 0"
    experts = {f"expert.L{layer}.E{e}" for layer in range(2) for e in range(4)}
    assert experts <= set(report["recovery_levels"]["operators"])
    assert res["digest"] == ref["digest"], "recovery with replicated experts must be bitwise exact"

    # ranks 0 and 1 (EP ranks 0 and 1, node 0): together every expert; the optimal plan for 3 1 2 2 is
    # [0 1 2 3] [0 0 2 3] (the only one surviving the loss of EP rank 1), so expert 0 is on both
    held = [_operators_in_store(os.path.join(store, "node0"), "faulty", r) for r in (0, 1)]
    for layer in range(2):
        on = [{op.expert for op in h if op.is_expert and op.layer == layer} for h in held]
        assert on[0] | on[1] == {0, 1, 2, 3}, on
        assert 0 in on[0] & on[1], f"layer {layer}: expert 0 must be snapshotted by both holders, {on}"
