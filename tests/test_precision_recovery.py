"""Low-precision recovery end to end (MoEvement §5.7): a rank is SIGKILLed inside a sparse window,
torchrun restarts the job, it recovers from the node-local store (sparse-to-dense replay with frozen
operators) and finishes bitwise equal to the fault-free run — with FP8 compute weights
(``--fp8-format e4m3 --fp8-emulation``: the frozen operators replay from their FP8 data, scale and amax
history alone) and with fp16 dynamic loss scaling (the scaler state of every replayed iteration comes from
the snapshot metadata). The digest (``moe_ft/digest.py``) covers the FP8 state and the loss scaler.

2 ranks (DP=EP=2, alltoall dispatcher, plain optimizer): half the start-up cost of the 4-rank drill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ft.cli.drill import ROOT, TINY, read_digest, read_reports
from moe_ft.drills.processes import kill_tree

pytestmark = pytest.mark.multiproc

ITERS, WINDOW = 8, 3
FP8 = ["--fp8-format", "e4m3", "--fp8-emulation", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
# fp16: a scale near the overflow threshold, growth after 2 clean steps: iterations overflow (skipped,
# hysteresis counts down, the scale backs off) and grow inside the 8 iterations
FP16 = ["--fp16", "--initial-loss-scale", "262144", "--loss-scale-window", "2", "--hysteresis", "2"]


def run_job(job: str, workdir: Path, store: Path, data: str, precision: list[str], faults=(),
            max_restarts: int = 0, timeout: float = 150) -> dict:
    digest_out, log = workdir / f"{job}.json", workdir / f"{job}.log"
    argv = [*TINY, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
            "--train-iters", str(ITERS), "--data-path", data, *precision,
            "--ft", "--ft-policy", "sparse", "--ft-sparse-window", str(WINDOW), "--ft-store-dir", str(store),
            "--ft-job-id", job, "--ft-digest-out", str(digest_out), "--log-interval", "1"]
    if faults:
        argv += ["--ft-fail", *faults]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "moe_ft.drills.prelaunch", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "--monitor-interval=1", str(ROOT / "pretrain_gpt_moe.py"), *argv]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            rc = 124
    return {"rc": rc, "digest": read_digest(str(digest_out)), "reports": read_reports(str(store), job),
            "log": log.read_text()}


def recover_and_compare(tmp_path: Path, data: str, precision: list[str], name: str, *, kill_at: int,
                        start: int, end: int, ref_flags: tuple[str, ...] = ()) -> dict:
    """Fault-free and faulty run (rank 1 SIGKILLed before iteration ``kill_at``); the faulty run must go back
    to the window ``[start, end]``, replay ``start+1 .. end`` with frozen operators, re-execute ``end+1 ..
    kill_at-1`` and finish with the fault-free run's digest. Returns both runs and the store root."""
    store = tmp_path / "store"
    ref = run_job(f"{name}_ref", tmp_path, store, data, [*precision, *ref_flags])
    assert ref["rc"] == 0 and ref["digest"], ref["log"][-4000:]
    bad = run_job(f"{name}_faulty", tmp_path, store, data, precision, faults=[f"1:{kill_at}:forward"],
                  max_restarts=1)
    assert bad["rc"] == 0, bad["log"][-4000:]
    assert len(bad["reports"]) == 1, bad["log"][-4000:]
    report = bad["reports"][0]
    assert (report["recovery_point"]["start"], report["recovery_point"]["end"]) == (start, end)
    assert report["replayed_iterations"] == list(range(start + 1, end + 1))
    assert report["reexecuted_iterations"] == list(range(end + 1, kill_at))
    assert bad["digest"] == ref["digest"], "the recovered run is not the fault-free run"
    return {"ref": ref, "bad": bad, "store": store}


@pytest.mark.timeout(450)
def test_fp8_emulation_sparse_recovery_and_resume_are_bitwise(tmp_path, corpus):
    """Also ``--save``/``--load``: the FP8 state travels in the layers' ``_extra_state``, so a run resumed from
    the iteration-3 checkpoint ends with the same digest (without it the resumed layers would compute with
    the FP8 data quantized from the initial weights)."""
    from megatron.training.checkpointing import TRACKER_FILE
    from moe_ft.state.operators import Level
    from moe_ft.store import StoreConfig

    ckpt = tmp_path / "ckpt"
    # killed before iteration 4 (inside window [3, 5]): back to window [0, 2], iterations 1-2 replayed
    res = recover_and_compare(tmp_path, corpus, FP8, "fp8", kill_at=4, start=0, end=2,
                              ref_flags=("--save", str(ckpt), "--save-interval", "3"))
    (ckpt / TRACKER_FILE).write_text("3")  # resume from the checkpoint after 3 iterations
    resumed = run_job("fp8_resumed", tmp_path, tmp_path / "store", corpus, [*FP8, "--load", str(ckpt)])
    assert resumed["rc"] == 0 and "resumed from" in resumed["log"], resumed["log"][-4000:]
    assert resumed["digest"] == res["ref"]["digest"], "the run resumed from --load is not the continuous run"
    # what the snapshots hold: an expert's COMPUTE entry is its FP8 state only (FP8 bytes, scales, amax
    # history), no wide weight; FULL adds the fp32 weight (the aliased master) and Adam's state
    store = StoreConfig(root=str(res["store"]), job_id="fp8_ref", rank=0).build()
    catalog = store.catalog()
    seen = set()
    for it in catalog.iterations:
        for op in sorted(o for o in catalog.operators() if o.is_expert):
            level = catalog.level(it, op)
            if level == Level.NONE or level in seen:
                continue
            seen.add(level)
            entry = store.load(it, op, level)
            fp8 = {n: t for n, t in entry.items() if ".fp8_" in n}
            assert {n.rsplit(".", 1)[1] for n in fp8} == {"fp8_data", "fp8_scale_inv", "fp8_scale", "fp8_amax_history"}
            assert all(t.dtype == torch.float8_e4m3fn for n, t in fp8.items() if n.endswith("fp8_data"))
            wide = [n for n in entry if n.endswith(("linear_fc1.weight", "linear_fc2.weight"))]
            assert (level == Level.COMPUTE) == (not wide), (level, sorted(entry))
            if level == Level.COMPUTE:  # FP8 state only: 1 byte per weight element plus a few scalars
                assert set(entry) == set(fp8)
            history = next(t for n, t in fp8.items() if n.endswith("linear_fc1.weight.fp8_amax_history"))
            # newest first: the initial quantization and one per step so far, at most the history length
            assert int((history > 0).sum()) == min(it + 2, 4)
    assert seen == {Level.COMPUTE, Level.FULL}


@pytest.mark.timeout(300)
def test_fp16_loss_scaler_sparse_recovery_is_bitwise(tmp_path, corpus):
    from moe_ft.store import StoreConfig

    # killed before iteration 7: back to window [3, 5], iterations 4-5 replayed, 6 re-executed. The scale
    # grows after every 2 clean steps until iterations overflow (skipped, hysteresis counts down, the scale
    # backs off): the replay must reproduce a skipped step and the scaler's count-down exactly
    res = recover_and_compare(tmp_path, corpus, FP16, "fp16", kill_at=7, start=3, end=5)
    skipped = [line for line in res["ref"]["log"].splitlines() if line.startswith("iteration") and "skipped" in line]
    skipped_iters = {int(line.split()[1].split("/")[0]) - 1 for line in skipped}
    print(f"skipped iterations of the fault-free run: {sorted(skipped_iters)}")
    assert skipped_iters & {4, 5}, f"no overflow inside the replayed iterations 4-5: {skipped}"
    store = StoreConfig(root=str(res["store"]), job_id="fp16_ref", rank=0).build()
    scalers = [store.load_meta(p).meta["grad_scaler"] for p in store.points()]
    states = {json.dumps(s, sort_keys=True) for s in scalers}
    assert len(states) > 1 and all(s is not None for per_opt in scalers for s in per_opt)


@pytest.mark.timeout(300)
def test_fp8_delayed_scaling_recovers_bitwise_under_localized_recovery(corpus, tmp_path):
    """``moe-ft drill --layout pp4 --fail 2:9:backward`` with FP8 weights under delayed scaling: only the
    failed stage replays (localized), from its FP8 data, scales and amax histories, and the job ends bitwise
    equal to the fault-free run, the recovery labelled exact. Delayed scaling's amax reduction is no obstacle:
    Megatron-Core reduces amaxes within one pipeline stage's tensor- and data-parallel ranks, and a localized
    replay replays whole stages (docs/precision.md)."""
    from types import SimpleNamespace

    from moe_ft.cli.drill import drill

    out = drill(SimpleNamespace(
        layout="pp4", policy="sparse", iters=12, window=3, recovery_scope="localized", fail=["2:9:backward"],
        nodes=1, fail_node=[], elastic=False, join_node=[], replicas=0, persist_interval=-1, persist_dir="",
        max_restarts=3, data=corpus, workdir=str(tmp_path / "work"), store_dir=str(tmp_path / "store"),
        keep_store=False, timeout=280, json=True, extra=FP8))
    assert out["faultfree_rc"] == 0 and out["faulty_rc"] == 0, out.get("faulty_logs")
    (report,) = out["reports"]
    assert report["scope"]["mode"] == "localized" and report["scope"]["replaying"] == [2], report["scope"]
    assert report["recovery_levels"]["level"] == "exact", report["recovery_levels"]
    assert out["equal"], "the recovered run must equal the fault-free run bitwise"
