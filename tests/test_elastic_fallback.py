"""Bad input to the elastic runtime (Lazarus §4.3): a world change that live copies cannot serve falls back,
with the reason, never silently.

A 4-rank ``--ft-elastic`` run with sparse snapshots and no survivor points (``--ft-recovery-scope global``:
survivors do not publish their state) trains 5 iterations; the same job then starts on 2 ranks. No point on
the node holds every operator at FULL (a sparse window spreads them over several iterations), so the
decision is ``fallback``: the reason is printed and written to ``elastic_1.json``, the old generation's
points are dropped, and the usual recovery path takes the newest complete recovery point every rank can
load -- here none (no durable tier, no ``--load``): training starts again from iteration 0 and completes.
"""

from __future__ import annotations

import json

import pytest

from tests._ft_helpers import tiny_model_flags, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, log_interval=1, seed=1234)
ELASTIC = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
           "--ft-expert-slots", "4", "--ft", "--ft-policy", "sparse", "--ft-sparse-window", "3",
           "--ft-replicas", "0", "--ft-recovery-scope", "global", "--ft-elastic"]


def test_shrink_without_a_complete_point_falls_back_with_the_reason(corpus, tmp_path):
    report = tmp_path / "reports"
    common = [*MODEL, "--data-path", corpus, *ELASTIC, "--ft-store-dir", str(tmp_path / "store"),
              "--ft-report-dir", str(report)]
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "5"], nproc=4, timeout=300)
    proc = torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "6"], nproc=2, timeout=300)
    out = json.loads((report / "elastic_1.json").read_text())
    assert out["kind"] == "fallback" and (out["previous_world_size"], out["world_size"]) == (4, 2)
    assert "no point has every operator at FULL" in out["reason"] and "survivor point" in out["reason"]
    assert "moe-ft elastic: falling back to the newest complete recovery point" in proc.stdout
    trained = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert trained[0].startswith("iteration      1/6") and trained[-1].startswith("iteration      6/6"), trained
