"""An elastic reshape restore that meets corrupt entries (``moe_ft/elastic/restore.py``): every rank learns of
them together, a corrupt copy is excluded and another copy taken, and when an operator has no readable copy
left every rank fails together and the next start decides on another point (no restart loop).

A 4-rank ``--ft-elastic`` run (flexible dispatcher, replicas 3 1 2 2 over 4 slots per EP rank, dense
snapshots) trains 4 iterations; then two entries of its newest point (iteration 3) are damaged on the node:
the embedding in old rank 0's store (every old rank holds a copy) and every copy of expert 1 of layer 0 (one
replica per data-parallel group). The same job restarts on 2 ranks (``--max-restarts 1``): the first start
excludes both copies, finds no other copy of the expert, and every rank stops with the reason after
deleting the damaged points; the second start reshapes from iteration 2 (whose embedding in old rank 0's
store is damaged too: excluded, another copy read) and trains to the end.
"""

from __future__ import annotations

import json

import pytest

from moe_ft.drills.faults import flip_middle_byte
from moe_ft.state.operators import OperatorId
from moe_ft.store import StoreConfig
from tests._ft_helpers import tiny_model_flags, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, log_interval=1, seed=1234)
ELASTIC = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
           "--ft-expert-slots", "4", "--ft", "--ft-policy", "dense", "--ft-replicas", "0", "--ft-elastic"]


def _damage(store_root: str, job: str, iteration: int, op: OperatorId, only: int | None = None) -> list[int]:
    """Flip a byte in the FULL entry of ``op`` at ``iteration`` in every old rank's store that holds it
    (``only``: in that rank's store only); returns the ranks damaged."""
    damaged = []
    for rank in range(4):
        if only is not None and rank != only:
            continue
        store = StoreConfig(root=store_root, job_id=job, rank=rank).build()
        point = {p.iteration: p for p in store.catalog().points()}.get(iteration)
        if point is None or op not in point.entries:
            continue
        entry = point.entries[op]
        flip_middle_byte(*store.backend.blob_location(iteration, entry.blob))
        damaged.append(rank)
    return damaged


def test_corrupt_copies_are_excluded_and_a_lost_operator_fails_every_rank_together(corpus, tmp_path):
    store, report = str(tmp_path / "store"), tmp_path / "reports"
    common = [*MODEL, "--data-path", corpus, *ELASTIC, "--ft-store-dir", store, "--ft-report-dir", str(report),
              "--ft-job-id", "corrupt"]
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "4"], nproc=4, timeout=300)
    assert _damage(store, "corrupt", 3, OperatorId.embedding(), only=0) == [0]
    assert _damage(store, "corrupt", 3, OperatorId.expert_op(0, 1))  # every copy (one per data-parallel replica)
    assert _damage(store, "corrupt", 2, OperatorId.embedding(), only=0) == [0]  # the fallback point's too
    # a longer run than the one that saved the snapshots: the flags' LR schedule from the reshape's point
    proc = torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "6", "--override-opt-param-scheduler"], nproc=2,
                    timeout=300, max_restarts=1)
    out = proc.stdout + proc.stderr
    assert "ElasticRestoreFailed: the agreed point 3 cannot be restored" in out, out[-4000:]
    assert "expert.L0.E1 of old rank" in out and "embedding of old rank 0" in out
    # every rank raised it from the same gathered state, at once (the first to exit may make the agent stop
    # the other before it prints): no rank waited out a group timeout
    assert any(line.startswith("moe-ft survivor: rank ") and "ElasticRestoreFailed" in line for line in out.splitlines())
    assert "timed out" not in out.lower() and "DistBackendError" not in out
    elastic = json.loads((report / "elastic_1.json").read_text())
    assert elastic["kind"] == "reshape" and elastic["point"] == 2, elastic
    # the second start excluded old rank 0's corrupt embedding and read another copy on the node
    assert [(c["name"], c["rank"], c["reader"]) for c in elastic["excluded"]] == [("embedding", 0, 0)], elastic["excluded"]
    trained = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert trained[-1].startswith("iteration      6/6"), trained
    assert 3 not in StoreConfig(root=store, job_id="corrupt", rank=0).build().points()  # damaged: deleted
