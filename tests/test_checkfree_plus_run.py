"""``--ft-checkfree-plus`` in a real run (CheckFree+): PP=4 under torchrun with ``pretrain_gpt_moe.py``.

* every stage runs the odd micro-batches (1 and 3 of 4) with its swap partner's layers, every iteration
  (printed by ``PartnerSwapComponent``: observable in the log);
* the run is deterministic (two launches give the same training-state digest) and the swap changes the
  training (a run without the flag ends with another digest);
* the holders keep the embedding (stage 1) and output-layer (stage 2) copies, versioned by iteration, the
  newest one of the last iteration.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moe_ft.checkfree.copies import CopyStore
from moe_ft.cli.drill import run_job
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig

pytestmark = pytest.mark.multiproc

ITERS = 4
PP4 = ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "1", "--num-layers", "4"]


def _run(corpus: str, work: Path, job: str, extra: list[str]) -> dict:
    res = run_job(job=job, workdir=str(work), layout="ep2pp2", policy="sparse", iters=ITERS, data=corpus,
                  store=str(work / "store"), window=2, extra=[*PP4, *extra], timeout=300)
    assert res["rc"] == 0 and res["digest"], f"{job} failed (rc {res['rc']}), see {res['log']}"
    return res


@pytest.mark.timeout(480)
def test_checkfree_plus_run_swaps_and_copies(corpus, tmp_path):
    first = _run(corpus, tmp_path, "plus_a", ["--ft-checkfree-plus"])
    again = _run(corpus, tmp_path, "plus_b", ["--ft-checkfree-plus"])
    plain = _run(corpus, tmp_path, "plain", [])
    assert first["digest"] == again["digest"]  # deterministic, swap exchange included
    assert first["digest"] != plain["digest"]  # the swapped micro-batches trained the model differently

    log = Path(first["log"]).read_text()
    partner = {0: 1, 1: 0, 2: 3, 3: 2}
    for rank in range(4):  # 4 micro-batches per iteration: the odd ones (1 and 3) swap, in every iteration
        line = rf"moe-ft checkfree\+ rank {rank} \(stage {rank}\): {ITERS} iterations swapped micro-batches " \
               rf"\[\[1, 3\]\] with rank {partner[rank]}"
        assert re.search(line, log), log[-3000:]
    assert "checkfree+" not in Path(plain["log"]).read_text()

    copies = tmp_path / "store" / "plus_a" / "checkfree_copies"
    held = {d.name: sorted(".".join(p.name.split(".")[:2]) for p in d.iterdir()) for d in copies.iterdir()}
    assert set(held) == {"rank1", "rank2"}  # the embedding's and the output layer's holders only
    assert all(n.startswith("embedding.") for n in held["rank1"]) and all(n.startswith("output.") for n in held["rank2"])
    assert held["rank1"][-1] == f"embedding.{ITERS - 1:012d}" and held["rank2"][-1] == f"output.{ITERS - 1:012d}"
    # each copy is the owner's weights after that iteration's step, bit for bit: the owner's own snapshot
    # of the same iteration (FULL or COMPUTE entry of the sparse window) holds the same compute weights
    for kind, owner, holder in (("embedding", 0, 1), ("output", 3, 2)):
        snapshots = StoreConfig(root=str(tmp_path / "store"), job_id="plus_a", rank=owner).build()
        copies_of = CopyStore(copies / f"rank{holder}")
        compared = 0
        for it in snapshots.points():
            op = getattr(OperatorId, kind)()
            level = snapshots.catalog([it]).level(it, op)
            assert level in (Level.FULL, Level.COMPUTE), (kind, it, level)
            entry = snapshots.load(it, op, level)
            copy = copies_of.load(kind, it)
            assert set(copy) <= set(entry)
            assert all(torch.equal(copy[n].view(torch.uint8), entry[n].view(torch.uint8)) for n in copy), (kind, it)
            compared += 1
        assert compared >= 2, (kind, snapshots.points())
