"""Recovery after losing a node, through the real runtime, in one torchrun of 4 gloo
ranks simulating two nodes of two ranks (``--ft-ranks-per-node 2``), DP=2×EP=2 with the distributed
optimizer, ``sparse``, ``r = 1``:

rank 2 is killed mid-window (after a ``--save`` checkpoint at iteration 3), then everything node 1 held is deleted (ranks 2 and 3's node-local stores,
the replicas node 1 kept for ranks 0 and 1, its progress files). The relaunched job rebuilds node 1's
stores from node 0 — FULL entries (distributed-optimizer shards) from the replica holders, COMPUTE
entries deduplicated by MoEtion §5.1 from the expert-/data-parallel peers' own stores — recovers exactly
from the in-memory window [0, 3] (newer than the checkpoint) and ends bitwise equal to the fault-free
run. The two-agent drill (``moe-ft drill --nodes 2``) exercises
the same mechanism with real torchrun agents dying.
"""

import json
import shutil

import pytest

from tests._ft_helpers import tiny_model_flags, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

FLAGS = [*tiny_model_flags("dp2ep2", moe_token_dispatcher_type="allgather", train_iters=10,
                          log_interval=100, seed=7),
         "--ft", "--ft-policy", "sparse", "--ft-sparse-window", "4", "--ft-job-id", "job",
         "--ft-ranks-per-node", "2", "--ft-replicas", "1"]


def test_lost_node_rebuilt_from_peers_is_exact(tmp_path, corpus):  # noqa: F811
    data = ["--data-path", corpus]
    torchrun("pretrain_gpt_moe.py", [*data, *FLAGS, "--ft-store-dir", str(tmp_path / "ref"),
                                     "--ft-digest-out", str(tmp_path / "ref.json")], timeout=150)
    store = tmp_path / "store"
    ckpt = tmp_path / "ckpt"  # a --save checkpoint at iteration 3: the relaunch --loads it (start 3), and
    # recovery must still find the windows [0, 3], [4, 7] the first run recorded (not windows aligned to 3)
    killed = torchrun("pretrain_gpt_moe.py", [*data, *FLAGS, "--ft-store-dir", str(store), "--ft-fail", "2:5",
                                              "--save", str(ckpt), "--save-interval", "3"], timeout=150, check=False)
    assert killed.returncode != 0
    job = store / "job"
    # simulated nodes share one store root: each holder keeps its replicas in a directory of its own
    assert (job / "rank2" / "points").is_dir() and list((job / "replicas").glob("holder[23]/rank0/points"))
    for lost in ["rank2", "rank3", "replicas/holder2", "replicas/holder3"]:  # node 1 is gone
        shutil.rmtree(job / lost)
    for rank in (2, 3):
        (job / f"progress_rank{rank}").unlink()
    reports = tmp_path / "reports"
    torchrun("pretrain_gpt_moe.py", [*data, *FLAGS, "--ft-store-dir", str(store), "--ft-fail", "2:5",
                                     "--ft-recover", "always", "--ft-report-dir", str(reports), "--load", str(ckpt),
                                     "--ft-digest-out", str(tmp_path / "recovered.json")], timeout=150)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    report = json.loads((reports / "recovery_000.json").read_text())
    point = report["recovery_point"]
    assert point["source"] == "memory" and (point["start"], point["end"]) == (0, 3), point
    fetched = point["fetched"]
    assert sorted(fetched) == ["2", "3"], fetched
    for rank in ("2", "3"):
        assert fetched[rank]["points"][:4] == [0, 1, 2, 3] and not fetched[rank]["skipped"], fetched[rank]
        assert fetched[rank]["sources"] and set(fetched[rank]["sources"]) <= {0, 1}, fetched[rank]  # node 0
    assert report["replayed_iterations"] == [1, 2, 3] and report["reexecuted_iterations"] == [4]
    assert json.loads((tmp_path / "recovered.json").read_text()) == json.loads((tmp_path / "ref.json").read_text())
