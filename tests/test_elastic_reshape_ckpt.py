"""Megatron checkpoints taken before and after a shrink load into a plain Megatron-Core
``GPTModel`` (standard alltoall expert parallelism, no moe-ft runtime).

1. ``--ft-elastic`` run on 4 ranks (flexible dispatcher, replicas 3 1 2 2, dense snapshots): 4 iterations,
   ``--save`` after 4; its final parameters are dumped (experts by global id).
2. The same job restarted on 2 ranks with ``--train-iters 8 --override-opt-param-scheduler`` (the snapshots hold
   the 4-iteration run's LR schedule): the world shrank, the job re-plans (reshape from iteration 3) and
   trains to 8 with the flags' schedule, ``--save`` after 8; parameters dumped again.
3. Each checkpoint is loaded by ``tests/_workers_elastic_ckpt.py`` into standard EP (alltoall, EP=2) on 2
   ranks -- the one taken on 4 ranks too (``megatron/training/checkpointing.py`` then skips the per-rank RNG
   state, as Megatron-LM does on a changed world size): every parameter equals the dump of the run that saved
   it, bitwise -- the expert layout does not depend on the replica plan or the world size.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from moe_ft.drills.report import load_parameters
from tests._ft_helpers import tiny_model_flags, torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

MODEL = tiny_model_flags("ep2", hidden_size=64, seq_length=64, log_interval=100, seed=1234)
ELASTIC = ["--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "3", "1", "2", "2",
           "--ft-expert-slots", "4", "--ft", "--ft-policy", "dense", "--ft-replicas", "0", "--ft-elastic"]
_MINE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.E(\d+)\.(.+)$")


def _as_worker_names(params: dict) -> dict:
    """``decoder.layers.i.mlp.experts.E<e>.<p>`` (drill dump) -> ``L<i>.E<e>.<p>`` (checkpoint worker)."""
    out = {}
    for name, value in params.items():
        m = _MINE.match(name)
        out[f"L{m[1]}.E{m[2]}.{m[3]}" if m else name] = value
    return out


def _loaded(out_dir: str) -> dict:
    merged = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "state_start_rank*.pt"))):
        for name, value in torch.load(path).items():
            if "#" not in name:  # parameters only (Adam state is covered by test_elastic_ckpt.py)
                merged[name] = value.float()
    return merged


def test_checkpoints_before_and_after_a_shrink_load_into_standard_ep(corpus, tmp_path):
    store, report = str(tmp_path / "store"), tmp_path / "reports"
    common = [*MODEL, "--data-path", corpus, *ELASTIC, "--ft-store-dir", store, "--ft-report-dir", str(report)]
    before, after = tmp_path / "ckpt_before", tmp_path / "ckpt_after"
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "4", "--save", str(before), "--save-interval", "4",
                                     "--ft-digest-out", str(tmp_path / "a.json")], nproc=4, timeout=300)
    # the 4-rank run's snapshots hold its LR schedule (decay over 4 iterations); this run asks for 8: it trains
    # with the flags' schedule from the snapshot's position (without a choice the reshape is refused)
    torchrun("pretrain_gpt_moe.py", [*common, "--train-iters", "8", "--save", str(after), "--save-interval", "8",
                                     "--ft-digest-out", str(tmp_path / "b.json"), "--override-opt-param-scheduler"],
             nproc=2, timeout=300)
    assert (report / "elastic_1.json").exists(), "the 2-rank start must have re-planned (world 4 -> 2)"
    for ckpt, dump, iters, nproc in ((before, "a.json", 4, 2), (after, "b.json", 8, 2)):
        out = str(tmp_path / f"load_{ckpt.name}")
        # each checkpoint holds the schedule of the --train-iters it was saved with: no choice needed to load it
        torchrun("tests/_workers_elastic_ckpt.py", [*MODEL, "--data-path", corpus, "--out", out, "--load", str(ckpt),
                                                    "--train-iters", str(iters)], nproc=nproc, timeout=300)
        saved = _as_worker_names(load_parameters(sorted(glob.glob(str(tmp_path / f"{dump}.params_rank*.pt")))))
        loaded = _loaded(out)
        assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))[:5]
        for name, value in saved.items():
            assert torch.equal(value, loaded[name]), f"{ckpt.name}: {name} differs after loading into standard EP"
