"""The record of failed recovery decisions (``moe_ft/recovery/ledger.py``): what a rank records survives
the process, a torn record counts as none, the ranks' records merge, and the bound they put on a global
recovery is below every failed point."""

from __future__ import annotations

import json

from moe_ft.recovery.ledger import GLOBAL, LOCALIZED, Avoided, DecisionLedger


def test_record_load_clear(tmp_path):
    ledger = DecisionLedger(str(tmp_path), rank=2)
    assert not ledger.load() and ledger.load().below is None
    ledger.record(GLOBAL, 8, "RuntimeError: replay diverged at iteration 8")
    ledger.record(LOCALIZED, 9, "ValueError: entry does not match")
    again = DecisionLedger(str(tmp_path), rank=2).load()  # another process reads what this one wrote
    assert again.global_points == {8: "RuntimeError: replay diverged at iteration 8"}
    assert again.localized == {9: "ValueError: entry does not match"} and again.below == 7
    ledger.clear()
    assert not ledger.load()
    ledger.clear()  # nothing to clear: no error


def test_a_torn_record_counts_as_none(tmp_path):
    ledger = DecisionLedger(str(tmp_path), rank=0)
    ledger.record(GLOBAL, 5, "x")
    with open(ledger.path, "w") as f:
        f.write('{"global": {"5"')
    assert not ledger.load()


def test_ranks_merge_and_the_bound_is_below_every_failed_point():
    a = Avoided(localized={9: "a"}, global_points={8: "a"})
    b = Avoided.from_json(json.loads(json.dumps(Avoided(global_points={5: "b"}).to_json())))
    merged = a.merge(b)
    assert merged.localized == {9: "a"} and merged.global_points == {8: "a", 5: "b"} and merged.below == 4
    assert merged.to_json() == {"localized": {"9": "a"}, "global": {"5": "b", "8": "a"}}


def _driver_worker(rank: int, init: str, tmp: str) -> None:
    """``driver.recover`` on one gloo rank, the localized attempt standing in for a loading rank whose replaying
    peer failed: it rewrote the live weight with its survivor point, then every rank went to the global path."""
    import os
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from moe_ft.localized.scope import Scope
    from moe_ft.policy.dense import DenseConfig, DensePolicy
    from moe_ft.recovery import driver, localized
    from moe_ft.state.operators import OperatorId, OperatorInfo
    from moe_ft.store import MemoryBackend, SnapshotStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    weight = torch.zeros(4)  # the live state a new process starts from: the initial weights

    def run(inputs, scope):  # what localized.run does on a loading rank whose replaying peer then failed
        scope.rewrote_state = True
        weight.copy_(torch.full((4,), 7.0))
        scope.mode, scope.reason = "global", "localized replay failed, rank 1: RuntimeError: replay diverged"

    localized.decide = lambda inputs: Scope("localized", "stage 1 failed", target=7, failed=[1], replaying=[1],
                                            loading=[0])
    localized.run = run
    d0 = OperatorId.dense(0)
    cfg = SimpleNamespace(
        snapshot=SimpleNamespace(store_dir=tmp, job_id="job"),
        recovery=SimpleNamespace(min_recovery_level="none", recovery_scope="localized"),
        persist=SimpleNamespace(interval=0, root=lambda save: None),
        checkfree=SimpleNamespace(plus=False), job_dir=lambda: os.path.join(tmp, "job"))
    session = SimpleNamespace(store=SnapshotStore(MemoryBackend()), name="dense", realign_retention=lambda: None,
                              policy=DensePolicy(DenseConfig(), [OperatorInfo(op=d0, bytes_compute=16, bytes_full=48)]))
    inputs = driver.RecoveryInputs(
        config=cfg, state=SimpleNamespace(model=[object()], optimizer=SimpleNamespace(), scheduler=None),
        args=SimpleNamespace(training=SimpleNamespace(save=None)), rank=0, world_size=1, start_iteration=0,
        restart_count=1, step_fn=lambda t, o: None, registry=[d0], popularity=None, session=session,
        survivor=None, survivor_points=SimpleNamespace(discard=lambda: None, newest_meta=lambda: None))
    try:
        driver.recover(inputs)
        outcome = f"recovered with the live weight {weight.tolist()}"
    except RuntimeError as e:
        outcome = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, "outcome.txt"), "w") as f:
        f.write(outcome)


def test_a_failed_localized_attempt_and_no_common_point_is_an_error_not_a_resume_from_a_mixed_state(tmp_path):
    """The fallback resumes from the state the process started with; a localized attempt that failed after it
    loaded survivor points rewrote part of it, so training must not go on from it: the recovery fails, saying
    so, and the ledger keeps the next attempt (new processes) from trying the localized recovery again."""
    import torch.multiprocessing as mp

    mp.spawn(_driver_worker, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=1, join=True)
    outcome = (tmp_path / "outcome.txt").read_text()
    assert "the localized recovery to iteration 7 failed" in outcome and "must start again" in outcome, outcome
    assert DecisionLedger(str(tmp_path / "job"), rank=0).load().localized == {
        7: "localized replay failed, rank 1: RuntimeError: replay diverged"}
