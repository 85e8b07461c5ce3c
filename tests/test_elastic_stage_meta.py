"""An elastic reshape with pipeline parallelism restores each rank's step state from the metadata of its own
pipeline stage (``moe_ft/elastic/restore.py`` ``choose_meta``).

The metadata of a snapshot is per stage: Megatron seeds every stage's RNG with ``seed + 100 x stage``, and
with CheckFree the per-group learning rates (a rebuilt stage's 1.1x boost) and the recorded gradient norm
are the stage's own. The ranks are numbered again in the new world, and the restore took any metadata copy
of the point -- the rank's old number's first: PP=2 x DP=2 on 4 ranks (numbered pipeline last, so old rank
1 is stage 0) restarted on 2 ranks gave new rank 1, stage 1, the metadata of old rank 1, stage 0.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_ft.elastic.inventory import stage_atoms
from moe_ft.elastic.restore import choose_meta, meta_key
from moe_ft.state.operators import OperatorId
from moe_ft.store import StoreConfig
from tests._ft_helpers import tiny_model_flags, torchrun

MODEL = tiny_model_flags("pp2", log_interval=1, seed=1234)
ELASTIC = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-slots", "4", "--ft", "--ft-policy", "dense",
           "--ft-replicas", "0", "--ft-elastic"]


def test_a_rank_takes_the_metadata_of_its_own_stage_only():
    stage0 = stage_atoms([OperatorId.embedding(), OperatorId.dense(0), OperatorId.gate(0), OperatorId.expert_op(0, 1)])
    stage1 = stage_atoms([OperatorId.dense(1), OperatorId.expert_op(1, 3), OperatorId.output()])
    assert stage0 == {"embedding", "L0"} and stage1 == {"L1", "output"}
    # another expert-parallel rank of stage 1 holds other experts of the same layer: the same stage
    assert stage_atoms([OperatorId.dense(1), OperatorId.expert_op(1, 0), OperatorId.output()]) == stage1
    offers = [(meta_key(stage0), {"stage": sorted(stage0)}), (meta_key(stage1), {"stage": sorted(stage1)})]
    assert choose_meta(stage1, offers) == (meta_key(stage1), "")
    assert choose_meta(stage0, offers) == (meta_key(stage0), "")
    # a point holding part of the stage's operators (a sparse snapshot) is still the stage's
    assert choose_meta(stage0 | {"L2"}, offers[:1]) == (meta_key(stage0), "")
    key, error = choose_meta(stage1, offers[:1])
    assert key == "" and error.startswith("__meta__: no node has the metadata of this rank's pipeline stage "
                                          "(layers [1]) at the point"), error


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_reshaped_pipeline_rank_restores_its_own_stages_rng(corpus, tmp_path):
    store, report = str(tmp_path / "store"), tmp_path / "reports"
    common = [*MODEL, "--data-path", corpus, *ELASTIC, "--ft-store-dir", store, "--ft-report-dir", str(report),
              "--ft-job-id", "stages"]
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "4"], nproc=4, timeout=300)
    old = {r: StoreConfig(root=store, job_id="stages", rank=r).build() for r in range(4)}
    assert OperatorId.embedding() in old[1].catalog().point(3).entries  # old rank 1: stage 0
    rng = {r: old[r].load_meta(3).tensors["rng.torch_cpu"] for r in range(4)}
    # training draws nothing from the CPU generator (no dropout): the state a rank restores at 3 is the one
    # its next snapshot records; and the two stages' states differ (seeded per stage)
    assert torch.equal(old[2].load_meta(2).tensors["rng.torch_cpu"], rng[2])
    assert torch.equal(rng[0], rng[1]) and torch.equal(rng[2], rng[3]) and not torch.equal(rng[0], rng[2])

    # a longer run than the snapshots' schedule: keep theirs (Megatron-LM's rule, docs/recovery.md)
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "6", "--use-checkpoint-opt-param-scheduler"], nproc=2,
             timeout=300)
    elastic = json.loads((report / "elastic_1.json").read_text())
    assert (elastic["kind"], elastic["point"], elastic["world_size"]) == ("reshape", 3, 2), elastic
    for rank, (stage_op, same_as) in enumerate(((OperatorId.embedding(), 0), (OperatorId.output(), 2))):
        new = StoreConfig(root=store, job_id="stages", rank=rank).build()
        assert new.points() == [4, 5] and stage_op in new.catalog().point(4).entries
        assert torch.equal(new.load_meta(4).tensors["rng.torch_cpu"], rng[same_as]), \
            f"new rank {rank} restored another pipeline stage's RNG state"
