"""Bubble-aware snapshot scheduling (MoEtion §5.3, Alg. 4) on the CPU engine, without a model: the split
rule, the online bubble profiler, and the engine's copies landing in the bubbles the gate reports (or at the
deadline), with every snapshot still holding the state at ``submit``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.snapshot.bubbles import BubbleGate, BubbleSchedule, estimate_bubble_time_1f1b, split_parameters
from moe_ft.state.operators import Level
from moe_ft.store import KeepAll, StoreConfig
from tests._ft_helpers import wait_until
from tests.test_snapshot_engine import OPS, make_registry, step


def test_split_parameters_follows_algorithm_4():
    sizes = [40, 30, 20, 10]
    assert split_parameters(sizes, t_ss=1.0, t_bubble=2.0) == 4  # t_ss < t_bubble: everything in bubbles
    assert split_parameters(sizes, t_ss=2.0, t_bubble=1.0) == 1  # room ⌊100·1/2⌋ = 50 bytes: 40 fits, +30 not
    assert split_parameters(sizes, t_ss=1.0, t_bubble=0.7) == 2  # room 70: 40 + 30
    assert split_parameters(sizes, t_ss=1.0, t_bubble=0.0) == 0  # no bubble: all alongside computation
    assert split_parameters(sizes, t_ss=1.0, t_bubble=1.0) == 4  # t_ss == t_bubble: split, and all fit
    assert estimate_bubble_time_1f1b(pp_size=4, t_fwd_s=0.01, t_bwd_s=0.02) == pytest.approx(0.09)
    assert estimate_bubble_time_1f1b(pp_size=1, t_fwd_s=0.01, t_bwd_s=0.02) == 0.0
    with pytest.raises(ValueError):
        estimate_bubble_time_1f1b(pp_size=0, t_fwd_s=0.01, t_bwd_s=0.02)


def test_gate_profiles_idle_time_per_iteration():
    now = [0.0]
    gate = BubbleGate(lambda: now[0], keep_intervals=True)
    gate.enter()
    now[0] = 0.25
    gate.leave()
    gate.enter()
    now[0] = 0.5  # an exchange still open when the iteration ends
    assert gate.take_idle() == pytest.approx(0.5)
    now[0] = 0.75
    gate.leave()
    assert gate.take_idle() == pytest.approx(0.25)  # only the part after the previous take
    assert gate.intervals == [(0.0, 0.25), (0.25, 0.75)]
    give_up = threading.Event()
    give_up.set()
    assert gate.wait_open(give_up) is False
    gate.enter()
    assert gate.wait_open(threading.Event()) is True


@pytest.mark.timeout(60)
def test_copies_land_in_bubbles_or_at_the_deadline(tmp_path):
    registry = make_registry()
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    gate = BubbleGate(keep_intervals=True)
    schedule = BubbleSchedule(gate, trace=[])
    engine = SnapshotEngine(EngineConfig(num_slots=2, bubbles=schedule), registry, store)
    plan = {op: Level.FULL for op in OPS}
    expected = {}

    def bubble(seconds: float) -> None:
        gate.enter()
        time.sleep(seconds)
        gate.leave()

    try:
        # iteration 0: no bandwidth measured yet -> everything is W* (copied at once)
        bubble(0.05)
        expected[0] = {op: {n: t.clone() for n, t in registry[op].tensors(Level.FULL).items()} for op in OPS}
        engine.submit(0, plan, {"iteration": 0}, {})
        engine.wait_copied()
        step(registry)
        # iteration 1: 50 ms of bubble profiled, a few hundred bytes to copy -> everything waits for a bubble
        bubble(0.05)
        expected[1] = {op: {n: t.clone() for n, t in registry[op].tensors(Level.FULL).items()} for op in OPS}
        engine.submit(1, plan, {"iteration": 1}, {})
        # the copies wait for the stage to be idle: the bubble opens after the submit, and stays open (at
        # least 0.1 s) until every copy of the iteration landed in it (checked on the trace below)
        gate.enter()
        opened = time.perf_counter()
        wait_until(lambda: {p["op"] for p in schedule.trace if p["iteration"] == 1} == {str(op) for op in OPS},
                   timeout=30, message="iteration 1's copies in the bubble")
        time.sleep(max(0.0, 0.1 - (time.perf_counter() - opened)))
        gate.leave()
        bubble_1 = gate.intervals[-1]
        engine.wait_copied()
        step(registry)
        # iteration 2: the bubble estimate is the 0.1 s of iteration 1, but no bubble comes: forced at the deadline
        expected[2] = {op: {n: t.clone() for n, t in registry[op].tensors(Level.FULL).items()} for op in OPS}
        engine.submit(2, plan, {"iteration": 2}, {})
        time.sleep(0.02)
        engine.wait_copied()
        step(registry)
        # the last snapshot of a run: nobody waits for its copy before the end; flush must not wait for a
        # bubble that never comes
        bubble(0.05)
        expected[3] = {op: {n: t.clone() for n, t in registry[op].tensors(Level.FULL).items()} for op in OPS}
        engine.submit(3, plan, {"iteration": 3}, {})
        engine.flush()
    finally:
        engine.close()
    kinds = {it: {p["kind"] for p in schedule.trace if p["iteration"] == it} for it in range(4)}
    assert kinds == {0: {"compute"}, 1: {"bubble"}, 2: {"forced"}, 3: {"forced"}}
    for piece in schedule.trace:  # iteration 1 waited for the bubble that opened after its submit
        if piece["iteration"] == 1:
            assert bubble_1[0] <= piece["start"] <= bubble_1[1], (piece, bubble_1)
    for piece in schedule.trace:
        if piece["kind"] == "bubble":  # issued inside an idle interval of the stage
            assert any(s <= piece["start"] <= e for s, e in gate.intervals), (piece, gate.intervals)
    assert schedule.bandwidth is not None and schedule.bandwidth > 0
    for it, ops in expected.items():  # the schedule changes when bytes move, never what a snapshot holds
        for op, tensors in ops.items():
            loaded = store.load(it, op, Level.FULL)
            assert all(torch.equal(loaded[n], t) for n, t in tensors.items()), (it, op)
