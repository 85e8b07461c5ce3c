"""Virtual pipeline stages (Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``) in the training loop:
flag validation, and a real 4-rank job (PP=2 x EP=2, two model chunks per rank, Megatron-Core's interleaved
1F1B schedule) whose chunks hold the expected global layers, whose operators are named by global layer, and
whose checkpoint of every chunk resumes bitwise."""

from __future__ import annotations

import json
import os

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from tests._ft_helpers import torchrun

BASE = ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "4"]


@pytest.mark.parametrize("flags,chunks,per_chunk", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], 2, 2),
    (["--virtual-pipeline-model-parallel-size", "4"], 4, 1),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--virtual-pipeline-model-parallel-size", "4"], 4, 1),
    (["--num-layers-per-virtual-pipeline-stage", "4"], None, None),  # one chunk per rank: plain 1F1B
])
def test_virtual_stage_flags_resolve(flags, chunks, per_chunk, data_prefix):
    args = parse_args([*BASE, *flags, "--data-path", data_prefix], world_size=2)
    assert args.parallel.virtual_pipeline_model_parallel_size == chunks
    assert args.parallel.num_layers_per_virtual_pipeline_stage == per_chunk


@pytest.mark.parametrize("flags,world,message", [
    (["--pipeline-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "need --pipeline-model-parallel-size >= 2"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], 2, "4 layers per rank is not divisible by"),
    (["--virtual-pipeline-model-parallel-size", "3"], 2, "cannot be split into"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--virtual-pipeline-model-parallel-size", "4"], 2,
     "disagrees with"),
    (["--virtual-pipeline-model-parallel-size", "0"], 2, "must be positive"),
    (["--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "3"], 2,
     "needs the micro-batches per iteration \\(3\\) to be a multiple of --pipeline-model-parallel-size 2"),
])
def test_bad_virtual_stage_flags(flags, world, message, data_prefix):
    with pytest.raises(ArgumentError, match=message):
        parse_args([*BASE, *flags, "--data-path", data_prefix], world_size=world)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_interleaved_schedule_chunks_registry_and_checkpoint(tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    torchrun("tests/_workers_vpp.py", ["--out", str(out), "--data-path", corpus])
    ranks = [json.load(open(os.path.join(out, f"result_rank{r}.json"))) for r in range(4)]
    every_op = sorted(["embedding", "output"] + [f"{kind}.L{layer}" for kind in ("dense", "gate")
                                                 for layer in range(4)]
                      + [f"expert.L{layer}.E{e}" for layer in range(4) for e in range(4)])
    for rank, res in enumerate(ranks):
        pp, ep = res["pp_rank"], res["ep_rank"]
        assert res["num_chunks"] == 2, rank
        # virtual stage v of pipeline rank r holds global layer v*PP + r (1-based layer_number: +1)
        assert [c["layers"] for c in res["chunks"]] == [[pp + 1], [2 + pp + 1]], rank
        assert [c["pre_process"] for c in res["chunks"]] == [pp == 0, False], rank
        assert [c["post_process"] for c in res["chunks"]] == [False, pp == 1], rank
        layers = (pp, 2 + pp)
        expected = sorted([f"{kind}.L{layer}" for kind in ("dense", "gate") for layer in layers]
                          + [f"expert.L{layer}.E{e}" for layer in layers for e in (2 * ep, 2 * ep + 1)]
                          + (["embedding"] if pp == 0 else ["output"]))
        assert res["operators"] == expected, rank
        assert res["catalogue"] == every_op, rank
        assert res["resumed_from"] == 2 and res["resumed"] == res["straight"], rank
        assert 0 < res["eval_loss"] < 10 and res["eval_loss"] == ranks[0]["eval_loss"], rank
    last = [r for r in ranks if r["pp_rank"] == 1]
    for res in last:
        assert len(res["losses"]) == 4 and all(0 < x < 10 for x in res["losses"])
        assert res["losses_resumed"] == res["losses"][2:]
