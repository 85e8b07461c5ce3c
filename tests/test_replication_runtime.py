"""Replication + durable persistence through the runtime (4 gloo processes, EP=2 x PP=2, two simulated
nodes of 2 ranks via --ft-ranks-per-node): each rank's points reach its peer's replica directory bitwise
and verified, a complete durable point holds every expert of every layer, and the FT line reports lag."""

import pytest

from moe_ft.persist import DurableTier
from moe_ft.persist.validate import validate_durable, validate_experts
from moe_ft.replication import replica_store_config
from moe_ft.store import StoreConfig
from tests._ft_helpers import torchrun
from tests.test_runtime import FLAGS

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(200)]


def test_runtime_replicates_and_persists(tmp_path, corpus):
    store, durable = tmp_path / "store", tmp_path / "durable"
    proc = torchrun("pretrain_gpt_moe.py", ["--data-path", corpus, "--train-iters", "6", "--ft-store-dir", str(store),
                                            "--ft-job-id", "job", *FLAGS, "--ft-ranks-per-node", "2",
                                            "--ft-replicas", "1", "--ft-persist-interval", "3",
                                            "--ft-persist-dir", str(durable)], timeout=180)
    assert "| replica " in proc.stdout and " lag " in proc.stdout, proc.stdout[-2000:]
    for rank in range(4):
        own = StoreConfig(root=str(store), job_id="job", rank=rank).build()
        replica = replica_store_config(root=str(store), job_id="job", owner=rank).build()
        common = sorted(set(own.points()) & set(replica.points()))
        assert common and common[-1] == 5, (rank, own.points(), replica.points())
        catalog = replica.verify()
        assert not catalog.problems, catalog.problems
        for it in common:
            mine = own.catalog([it]).point(it)
            for entry in catalog.point(it).all_entries():
                assert entry.checksum == (mine.meta if entry.op is None else mine.entries[entry.op]).checksum
                assert replica.backend.read_blob(it, entry.blob) == own.backend.read_blob(it, entry.blob)
    tier = DurableTier(durable, "job", 4)
    done = tier.newest_complete()
    assert done is not None and done.end == 5, tier.complete_points()
    assert validate_experts(done.parts, num_layers=2, num_experts=4) == []
    assert validate_durable(durable / "moe_ft" / "job", num_layers=2, num_experts=4) == (5, [])
