"""Upstream logging and log-fed replay (MoEvement §3.4, ``docs/localized.md``).

Multi-process (real Megatron-Core 1F1B schedule, real optimizer, 4 gloo processes, ``_workers_localized.py``):
a fault-free run with logging on, then one pipeline stage reset to its state at iteration k replays
k .. N-1 *alone*, fed by its neighbours' logs and the collective log; its full state (weights, optimizer,
scheduler, RNG) must equal the fault-free final state bitwise. PP=4 (stages 1 and 2, one after the other:
the second is fed partly by logs the first replay wrote again) and PP=2 x EP2 (a stage's two ranks replay
together, the EP all-to-alls between them run for real).

Unit tests (one process): the log directory round trip, retention (iterations dropped exactly when a newer
recovery point completes), corrupt and missing entries raise :class:`LogUnavailable` subclasses naming the
entry and the fix, and the replay handler refuses what it cannot serve.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from moe_ft.drills.faults import flip_middle_byte
from moe_ft.localized.collective_log import CollectiveSeam
from moe_ft.localized.component import UpstreamLogging, oldest_needed
from moe_ft.localized.log_replay import LogFeed, LogReplay, LogSeams
from moe_ft.localized.log_store import (
    BWD,
    FWD,
    CollectiveResult,
    CorruptLogEntry,
    IterationLog,
    LogDir,
    LogUnavailable,
    MissingLogEntry,
)
from moe_ft.localized.upstream_log import P2PSeam
from tests._ft_helpers import damage_arena_blob, one_rank_gloo


def _log(t: int) -> IterationLog:
    g = torch.Generator().manual_seed(t)
    log = IterationLog(t)
    log.sends[(FWD, 2)] = [(1, torch.randn(16, 2, 32, generator=g)) for _ in range(4)]
    log.sends[(BWD, 0)] = [(1, torch.randn(16, 2, 32, generator=g)) for _ in range(4)]
    log.collectives[(0, 1, 2, 3)] = [CollectiveResult("all_reduce", [torch.randn(1, generator=g)]),
                                     CollectiveResult("all_gather", [torch.randn(3), torch.randn(3)])]
    return log


def test_log_dir_round_trip_bitwise(tmp_path):
    d = LogDir(tmp_path / "rank1")
    log = _log(7)
    written = d.write(log)
    assert d.iterations() == [7] and d.nbytes(7) == written > log.nbytes()
    sends = d.read(7, "send.fwd.to2")
    assert [v for v, _ in sends] == [1] * 4
    for (_, a), (_, b) in zip(sends, log.sends[(FWD, 2)]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    calls = d.read(7, "coll.0-1-2-3")
    assert [c.fn for c in calls] == ["all_reduce", "all_gather"] and len(calls[1].outputs) == 2
    assert torch.equal(calls[0].outputs[0], log.collectives[(0, 1, 2, 3)][0].outputs[0])
    arena = d._store().arena_bytes
    for _ in range(3):
        d.write(_log(7))  # a replay logs the iteration again: replaced atomically, in the same regions
    assert d.iterations() == [7] and not list((tmp_path / "rank1" / "staging").iterdir())
    assert d._store().arena_bytes == arena  # iterations reuse the arena's pages
    (tmp_path / "rank1" / "staging" / "000000000008.999999999.0").touch()  # a killed writer's leftover
    assert d.drop_before(7) == [] and d.iterations() == [7]
    assert not list((tmp_path / "rank1" / "staging").iterdir())


def test_corrupt_and_missing_entries_name_the_entry_and_the_fix(tmp_path):
    d = LogDir(tmp_path / "rank0")
    d.write(_log(3))
    flip_middle_byte(*d.location(3, "send.bwd.to0"))
    with pytest.raises(CorruptLogEntry, match=r"send\.bwd\.to0.*global replay \(--ft-recovery-scope global\)"):
        d.read(3, "send.bwd.to0")
    assert d.read(3, "send.fwd.to2")  # the other entries stay readable
    with pytest.raises(MissingLogEntry, match=r"no iteration 4 .*--ft-recovery-scope global"):
        d.read(4, "send.fwd.to2")
    damage_arena_blob(d._store(), 3, "coll.0-1-2-3", lambda data: None)
    with pytest.raises(MissingLogEntry, match=r"iteration 3 coll\.0-1-2-3 is missing"):
        d.read(3, "coll.0-1-2-3")
    damage_arena_blob(d._store(), 3, "MANIFEST.json", lambda data: b"{not json")
    with pytest.raises(CorruptLogEntry, match="manifest .* unreadable"):
        d.read(3, "send.fwd.to2")
    assert issubclass(CorruptLogEntry, LogUnavailable) and issubclass(MissingLogEntry, LogUnavailable)


def test_retention_drops_exactly_when_a_newer_recovery_point_completes(tmp_path):
    """Sparse windows of 3 (every operator FULL at the window start, metadata every iteration), the
    runtime's retention (KeepTwoRecoverable): the log keeps every iteration from the oldest kept point."""
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import KeepTwoRecoverable, MemoryBackend, SnapshotStore, SparseWindowRule

    ops = [OperatorId("dense", 0), OperatorId("expert", 0, 1)]
    store = SnapshotStore(MemoryBackend(), retention=KeepTwoRecoverable(rule=SparseWindowRule.aligned(ops, 3)))
    comp = UpstreamLogging(LogDir(tmp_path / "rank0"), LogSeams(P2PSeam(), CollectiveSeam({0: 0})))
    session = SimpleNamespace(store=store)
    drops = {}
    for t in range(13):
        comp.log_dir.write(_log(t))
        with store.begin(t) as point:
            if t % 3 == 0:
                for op in ops:
                    point.put(op, Level.FULL, {"w": torch.zeros(2)})
            point.put_meta({"iteration": t})
            point.publish()
        before = list(comp.dropped)
        comp.after_snapshot(t, {}, session, replaying=False)
        comp.drain()  # retention runs on the log's writer thread, behind the writes
        if comp.dropped != before:
            drops[t] = comp.dropped[len(before):]
        assert comp.log_dir.iterations() == list(range(oldest_needed(store), t + 1))
    # window [6, 8] completes at 8: [0, 2] is no longer among the newest two; [9, 11] at 11 drops [3, 5]
    assert drops == {8: [0, 1, 2], 11: [3, 4, 5]}


class _Comm(SimpleNamespace):
    pass


def _comm(prev, nxt, rank):
    cfg = SimpleNamespace(pipeline_dtype=torch.float32, use_ring_exchange_p2p=False, batch_p2p_comm=True)
    return _Comm(prev_rank=prev, next_rank=nxt, config=cfg, pp_group=SimpleNamespace(rank=lambda: rank),
                 virtual_pipeline_model_parallel_size=None)


def test_replay_handler_feeds_receives_drops_sends_and_serves_collectives():
    """Stage 1 of 4 replays alone: receives come from the feed (as fresh ``requires_grad`` buffers), sends
    to stages 0 and 2 are dropped, a stage-spanning collective is served bitwise, unused entries fail."""
    act, grad = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    norm = torch.tensor([3.25])
    feed = LogFeed(sends={(5, 0, FWD, 1): [(0, act)], (5, 2, BWD, 1): [(2, grad)]},
                   collectives={(5, (0, 1, 2, 3)): [CollectiveResult("all_reduce", [norm])]})
    seams = LogSeams(P2PSeam(), CollectiveSeam({0: 0, 1: 1, 2: 2, 3: 3}))
    comm = _comm(0, 2, 1)

    def real(**kw):
        raise AssertionError(f"no real p2p with non-replaying neighbours: {kw}")

    with LogReplay(seams, feed, replaying=[1], rank=1) as replay:
        with replay.iteration(5):
            got, _, reqs = replay.communicate(comm, real, tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                                              recv_next=False, tensor_shape=(16, 2, 32))
            assert got.requires_grad and torch.equal(got.detach(), act) and reqs is None
            _, got, _ = replay.communicate(comm, real, tensor_send_next=torch.ones(16, 2, 32), tensor_send_prev=None,
                                           recv_prev=False, recv_next=True, tensor_shape=(16, 2, 32))
            assert torch.equal(got.detach(), grad)
            out = torch.tensor([1.0])
            replay.collective((0, 1, 2, 3), "all_reduce", [out], call=lambda: pytest.fail("served"), spans=True)
            assert torch.equal(out, norm)
            with pytest.raises(MissingLogEntry, match=r"group \[0, 1, 2, 3\] call #1"):
                replay.collective((0, 1, 2, 3), "all_reduce", [out], call=None, spans=True)
            assert replay.collective((1,), "all_reduce", [out], call=lambda: "real", spans=False) == "real"
            with pytest.raises(ValueError, match="replay every rank of a stage together"):
                replay.collective((1, 5), "all_reduce", [out], call=None, spans=False)
        with pytest.raises(LogUnavailable, match=r"not consumed.*fwd from rank 0 \(1 of 1\)"):
            with replay.iteration(5):
                pass
    assert seams.p2p.replay is None and seams.collectives.replay is None


def _spawn(fn, nprocs: int, args: tuple) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    while not ctx.join(timeout=300):
        pass


def _run(tmp_path, corpus, extra, replay_sets, k=2, num_iters=5):
    from tests._workers_localized import log_worker

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "result{}.json")
    _spawn(log_worker, 4, (4, f"file://{tmp_path}/pg", corpus, extra, str(tmp_path / "store"), out, k, num_iters,
                           replay_sets))
    return [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "result*.json")))]


def _check(results, replay_sets, k, num_iters):
    assert len(results) == 4
    for res in results:
        assert res["changed"] > 0  # the replayed iterations change the state: a no-op replay would fail
        assert res["logged"] == list(range(num_iters))
        # rank 0 lost iteration k: its sends to stage 1 (PP=4) or its part of the collective log (EP) are gone
        assert "lacks" in res["missing_error"] and f"of iteration {k}" in res["missing_error"]
        assert "fall back to a global replay (--ft-recovery-scope global)" in res["missing_error"]
        for entry, ranks in zip(res["replays"], replay_sets):
            if res["rank"] in ranks:
                assert entry["differences"] == [], (res["rank"], entry["differences"][:5])
                assert entry["fetched_bytes"] > 0 and entry["sends_fed"] > 0 and entry["collectives_fed"] > 0
            else:
                assert entry["fetched_bytes"] == 0


@pytest.mark.multiproc
@pytest.mark.timeout(480)
def test_pp4_stage_replays_alone_from_logs_bitwise(corpus, tmp_path):
    # stage 1 alone, stage 2 alone, then stages 1 and 2 together (App. A: adjacent failed stages recover
    # jointly, their boundary runs for real, stages 0 and 3 serve the logs)
    replay_sets = [[1], [2], [1, 2]]
    results = _run(tmp_path, corpus, ["--pipeline-model-parallel-size", "4"], replay_sets)
    _check(results, replay_sets, 2, 5)
    bytes_per_it = {r["rank"]: sorted(set(r["log_bytes"].values())) for r in results}
    print("upstream log bytes per iteration, per rank:", bytes_per_it)
    assert all(len(v) == 1 and v[0] > 0 for v in bytes_per_it.values())


@pytest.mark.multiproc
@pytest.mark.timeout(480)
def test_pp2_ep2_stage_group_replays_together_bitwise(corpus, tmp_path):
    replay_sets = [[2, 3], [0, 1]]
    results = _run(tmp_path, corpus, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                   replay_sets)
    _check(results, replay_sets, 2, 5)


def test_collective_seam_records_and_serves_bitwise_and_composes_with_the_checker():
    """One gloo rank; the group is declared stage-spanning. Recording keeps the results in call order per
    group; under replay the same calls are served from the log without running (the inputs differ, the
    outputs equal the logged ones); the checker installed first still sees the real calls; uninstall
    restores torch.distributed."""
    import torch.distributed as dist

    from moe_ft.localized.upstream_log import LogRecorder
    from moe_ft.testing.collective_checker import CollectiveChecker

    originals = (dist.all_reduce, dist.all_gather_into_tensor)
    with contextlib.ExitStack() as cleanup:  # undone in reverse: the seam, the world, the checker
        chk = CollectiveChecker().install()
        cleanup.callback(chk.uninstall)
        cleanup.enter_context(one_rank_gloo())
        seam = CollectiveSeam({0: 0}).install()
        cleanup.callback(seam.uninstall)
        seam.spans_stages = lambda ranks: True
        rec = LogRecorder(LogDir("/nonexistent"))
        seam.recorder = rec
        rec.begin(4)
        a, g = torch.tensor([1.5, 2.5]), torch.empty(3)
        dist.all_reduce(a)
        dist.all_gather_into_tensor(g, torch.tensor([7.0, 8.0, 9.0]))
        work = dist.all_reduce(torch.tensor([0.25]), async_op=True)
        work.wait()
        calls = rec.current.collectives[(0,)]
        assert [c.fn for c in calls] == ["all_reduce", "all_gather_into_tensor", "all_reduce"]
        assert torch.equal(calls[1].outputs[0], torch.tensor([7.0, 8.0, 9.0]))
        rec.abandon()
        seam.recorder = None
        real_calls = len(chk.records)
        feed = LogFeed(collectives={(4, (0,)): calls})
        seams = LogSeams(P2PSeam(), seam)
        with LogReplay(seams, feed, replaying=[1, 2], rank=1) as replay, replay.iteration(4):
            b, h = torch.tensor([-1.0, -1.0]), torch.zeros(3)
            assert dist.all_reduce(b) is None
            dist.all_gather_into_tensor(h, torch.tensor([0.0, 0.0, 0.0]))
            assert dist.all_reduce(torch.tensor([9.0]), async_op=True).wait()
        assert torch.equal(b, a) and torch.equal(h, g)
        assert len(chk.records) == real_calls  # served: nothing reached torch.distributed
    assert (dist.all_reduce, dist.all_gather_into_tensor) == originals


def test_p2p_seam_installs_once_records_sends_and_opens_idle_gates(tmp_path):
    from megatron.core.pipeline_parallel import schedules

    from moe_ft.localized.upstream_log import LogRecorder

    original = schedules.P2PCommunicator
    seam = P2PSeam().install()
    try:
        assert P2PSeam.current() is seam and schedules.P2PCommunicator is not original
        with pytest.raises(RuntimeError, match="already installed"):
            P2PSeam().install()

        class Gate:
            open = False

            def enter(self):
                self.open = True

            def leave(self):
                self.open = False

        gate = Gate()
        seam.idle_gates.append(gate)
        seam.recorder = LogRecorder(LogDir(tmp_path / "rank1"))
        seam.recorder.begin(0)
        act, grad = torch.randn(4, 2), torch.randn(4, 2)
        sent = act.clone()
        seen = []
        seam.communicate(_comm(0, 2, 1), lambda **kw: seen.append(gate.open) or (None, None, None),
                         tensor_send_next=act, tensor_send_prev=grad, recv_prev=False, recv_next=False,
                         tensor_shape=None)
        assert seen == [True] and not gate.open
        act.add_(1.0)  # Megatron may free or reuse the sent tensor: the log holds a copy
        assert seam.recorder.end() == 2 * act.numel() * 4
        logged = LogDir(tmp_path / "rank1")
        assert torch.equal(logged.read(0, "send.fwd.to2")[0][1], sent)
        (vstage, logged_grad), = logged.read(0, "send.bwd.to0")
        assert vstage == 1 and torch.equal(logged_grad, grad)
    finally:
        seam.uninstall()
    assert P2PSeam.current() is None and schedules.P2PCommunicator is original


def test_transfer_plan_serves_each_replayer_once_and_names_what_is_missing():
    """PP=4 on ranks 0..3, stage 2 replays: rank 1 sends it activations, rank 3 gradients; the collective
    log of the all-rank group comes from the lowest member that has it (rank 0, then rank 1 for the
    iteration rank 0 lost); a send dropped by retention and corrupt entries are reported."""
    from moe_ft.localized.log_replay import plan_transfers

    rec = (100, "ab", "xxh3_64")
    pp = [0, 1, 2, 3]

    def inv(offers, problems=()):
        return {"offers": {k: rec for k in offers}, "problems": list(problems), "pipeline_ranks": pp}

    its = [4, 5]
    coll = "coll.0-1-2-3"
    inventories = [inv([(4, coll)]),
                   inv([(4, "send.fwd.to2"), (5, "send.fwd.to2"), (4, coll), (5, coll)]),
                   inv([]),
                   inv([(4, "send.bwd.to2"), (5, "send.bwd.to2"), (4, coll), (5, coll)])]
    transfers, missing, problems = plan_transfers(inventories, frozenset([2]), its)
    assert missing == [] and problems == []
    assert [(s, d, t, n) for s, d, t, n, *_ in transfers] == [
        (0, 2, 4, coll), (1, 2, 4, "send.fwd.to2"), (1, 2, 5, coll), (1, 2, 5, "send.fwd.to2"),
        (3, 2, 4, "send.bwd.to2"), (3, 2, 5, "send.bwd.to2")]
    inventories[3] = inv([(4, "send.bwd.to2")], problems=["rank 3: corrupt upstream log entry ..."])
    inventories[1]["offers"].pop((5, coll))
    _, missing, problems = plan_transfers(inventories, frozenset([2]), its)
    assert missing == ["no surviving member of group 0-1-2-3 has its collective log of iteration 5",
                       "rank 3 has no upstream log entry send.bwd.to2 of iteration 5"]
    assert problems == ["rank 3: corrupt upstream log entry ..."]
    # stages 1 and 2 replay together: their boundary is live, only ranks 0 and 3 serve
    transfers, missing, _ = plan_transfers([inv([(4, "send.fwd.to1"), (4, coll)]), inv([]), inv([]),
                                            inv([(4, "send.bwd.to2"), (4, coll)])], frozenset([1, 2]), [4])
    assert missing == [] and {(s, d, n) for s, d, _, n, *_ in transfers} == {
        (0, 1, "send.fwd.to1"), (3, 2, "send.bwd.to2"), (0, 1, coll), (0, 2, coll)}


def test_a_background_recorder_publishes_in_order_behind_the_training_thread(tmp_path):
    """The runtime's recorder: ``end`` queues the iteration (the bytes it logged are known at once), retention
    queued with ``run_after`` runs after the writes before it, ``flush`` waits for all of it, a failed write
    surfaces on the training thread's next call, ``close`` publishes what is queued."""
    from moe_ft.localized.upstream_log import LogRecorder
    rec = LogRecorder(LogDir(tmp_path / "rank0"), background=True)
    sizes = []
    for t in range(5):
        rec.begin(t)
        rec.record_send("fwd", 1, 0, torch.full((8,), float(t)))
        sizes.append(rec.end())
    rec.run_after(lambda: rec.log_dir.drop_before(3))
    rec.flush()
    assert sizes == [32] * 5 and rec.log_dir.iterations() == [3, 4]
    assert torch.equal(rec.log_dir.read(4, "send.fwd.to1")[0][1], torch.full((8,), 4.0))
    rec.run_after(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="upstream log writer failed"):
        rec.flush()
    rec2 = LogRecorder(LogDir(tmp_path / "rank1"), background=True)
    rec2.begin(7)
    rec2.record_send("bwd", 0, 1, torch.ones(2))
    rec2.end()
    rec2.close()
    assert LogDir(tmp_path / "rank1").iterations() == [7]
