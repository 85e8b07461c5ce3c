"""Operator registry on the real Megatron-Core model and optimizers (4 gloo processes, real torchrun).

One launch per optimizer kind; inside it the worker builds EP=2 x PP=2 and then DP=2 x EP=2. Checked
against an independent walk of the model parameters and the torch optimizers' params and state: every
parameter and optimizer tensor belongs to exactly one operator, byte sizes are the exact sums of the
tensors' ``nbytes`` (fp32: the master is the parameter, counted once), each EP rank holds its own experts,
and the global catalogue lists every operator once with its stage and EP rank.
"""

from __future__ import annotations

import json
import os

import pytest

from tests._ft_helpers import torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

LAYOUTS = ["--expert-model-parallel-size 2 --pipeline-model-parallel-size 2", "--expert-model-parallel-size 2"]
EXPECTED_OPS = sorted(["embedding", "output", "dense.L0", "dense.L1", "gate.L0", "gate.L1"]
                      + [f"expert.L{l}.E{e}" for l in (0, 1) for e in range(4)])


def test_registry_partitions_model_and_optimizer(tmp_path, corpus):
    """One launch, four layouts: (EP=2 x PP=2, DP=2 x EP=2) x (plain, distributed optimizer)."""
    cases = [(layout, optimizer) for optimizer in ("plain", "distributed") for layout in LAYOUTS]
    args = ["--out", str(tmp_path), "--data-path", corpus]
    for layout, optimizer in cases:
        args += ["--layout", layout + (" --use-distributed-optimizer" if optimizer == "distributed" else "")]
    torchrun("tests/_workers_registry.py", args)
    ranks = [json.load(open(os.path.join(tmp_path, f"result_rank{r}.json"))) for r in range(4)]
    for idx, (layout, optimizer) in enumerate(cases):
        extra = " --use-distributed-optimizer" if optimizer == "distributed" else ""
        results = [r[idx] for r in ranks]
        for rank, res in enumerate(results):
            where = f"{layout}{extra} rank {rank}"
            assert res["multiply_owned"] == 0 and res["unowned"] == 0, where
            assert res["registry_bytes_full"] == res["independent_bytes"], where
            assert res["registry_bytes_compute"] == res["param_bytes"], where
            assert res["sizes_match_tensors"], where
            assert res["num_masters_separate"] == 0 and res["num_aliased"] > 0, where  # fp32: master = param
            assert res["num_optim"] > 0 and res["shard_sizes_ok"], where
            assert (res["shards"] > 0) == (optimizer == "distributed"), where
            ep = res["ep_rank"]
            layers = [res["pp_rank"]] if "pipeline" in layout else [0, 1]
            assert res["experts"] == sorted(f"expert.L{l}.E{e}" for l in layers for e in (2 * ep, 2 * ep + 1)), where
            assert sorted(res["catalogue"]) == EXPECTED_OPS, where
            assert res["catalogue"] == results[0]["catalogue"] and res["catalogue_keys"] == results[0]["catalogue_keys"]
        if optimizer == "distributed":  # DP shards differ: the optimizer state is really split
            assert len({r["shards"] for r in results}) > 1
