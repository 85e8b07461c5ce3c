"""Replication + durable persistence through the runtime (4 gloo processes, EP=2 x PP=2, two simulated
nodes of 2 ranks via --ft-ranks-per-node, dense policy):

* each rank's points reach its peer's replica directory bitwise and checksum-verified;
* a complete durable point holds every expert of every layer, every entry verified (``inspect --validate``);
* the FT line reports replication bytes and lag;
* the dense points written in the background in Megatron ``dist_checkpointing`` format load with plain
  ``--load`` and the resumed run ends bitwise equal to the uninterrupted one.
"""

import pytest

from moe_ft.persist import DurableTier
from moe_ft.persist.validate import validate_durable
from moe_ft.store import StoreConfig
from tests._ft_helpers import held_replica_store, torchrun
from tests.test_runtime import FLAGS

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(280)]


def test_runtime_replicates_and_persists(tmp_path, corpus):
    store, durable = tmp_path / "store", tmp_path / "durable"
    common_flags = ["--data-path", corpus, "--train-iters", "8", *FLAGS, "--ft-policy", "dense"]
    proc = torchrun("pretrain_gpt_moe.py", [*common_flags, "--ft-store-dir", str(store), "--ft-job-id", "job",
                                            "--ft-ranks-per-node", "2", "--ft-replicas", "1",
                                            "--ft-persist-interval", "3", "--ft-persist-dir", str(durable),
                                            "--ft-digest-out", str(tmp_path / "full.json")], timeout=180)
    assert "| replica " in proc.stdout and " lag " in proc.stdout, proc.stdout[-2000:]
    for rank in range(4):
        own = StoreConfig(root=str(store), job_id="job", rank=rank).build()
        replica = held_replica_store(store, "job", rank)
        common = sorted(set(own.points()) & set(replica.points()))
        assert common and common[-1] == 7, (rank, own.points(), replica.points())
        catalog = replica.verify()
        assert not catalog.problems, catalog.problems
        for it in common:
            mine = own.catalog([it]).point(it)
            for entry in catalog.point(it).all_entries():
                assert entry.checksum == (mine.meta if entry.op is None else mine.entries[entry.op]).checksum
                assert replica.backend.read_blob(it, entry.blob) == own.backend.read_blob(it, entry.blob)
    assert DurableTier(durable, "job", 4).complete_points()[-1] == 5
    assert validate_durable(durable / "moe_ft" / "job", num_layers=2, num_experts=4) == (5, [])
    assert (durable / "latest_checkpointed_iteration.txt").read_text() == "6"  # after iteration 5 (0-based)
    # plain Megatron --load of the background-written dense point, then the last 2 iterations
    resumed = torchrun("pretrain_gpt_moe.py", [*common_flags, "--ft-store-dir", str(tmp_path / "store2"),
                                               "--ft-replicas", "0", "--load", str(durable),
                                               "--ft-digest-out", str(tmp_path / "resumed.json")], timeout=120)
    assert f"resumed from {durable} at iteration 6" in resumed.stdout
    assert (tmp_path / "resumed.json").read_bytes() == (tmp_path / "full.json").read_bytes()
