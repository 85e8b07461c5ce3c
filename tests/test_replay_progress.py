"""The loading ranks of a localized recovery wait on the replay's progress in the store
(``moe_ft/recovery/heartbeat.py``), not on one collective bounded by the group timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from moe_ft.recovery.heartbeat import ReplayProgress, ReplayStalled


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def replayer(store, steps: int, step_s: float, prefix: str = "p/", finish: bool = True) -> threading.Thread:
    def run():
        progress = ReplayProgress(store, prefix, [2], stall_s=99.0)
        progress.start_alive()
        for _ in range(steps):
            time.sleep(step_s)
            progress.beat()
        if finish:
            progress.done()
        else:
            progress.stop_alive()  # the process died: no more beats, never done

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_replay_longer_than_the_bound_is_waited_for_while_it_progresses(store):
    thread = replayer(store, steps=6, step_s=0.2)  # 1.2 s of replay, each step well inside the 0.5 s bound
    waited = ReplayProgress(store, "p/", [2], stall_s=0.5).wait(poll_s=0.02)
    thread.join()
    assert waited > 1.0


def test_no_progress_for_the_bound_gives_up(store):
    thread = replayer(store, steps=1, step_s=1.5)  # alive, but one step takes longer than the bound
    t0 = time.monotonic()
    with pytest.raises(ReplayStalled, match="made no progress for 1 s"):
        ReplayProgress(store, "p/", [2], stall_s=0.6).wait(poll_s=0.02)
    assert time.monotonic() - t0 < 1.2
    thread.join()


def test_a_replayer_that_stops_beating_is_noticed_sooner_than_the_progress_bound(store):
    thread = replayer(store, steps=1, step_s=0.1, finish=False)
    with pytest.raises(ReplayStalled, match="stopped beating"):
        ReplayProgress(store, "p/", [2], stall_s=60.0, dead_s=1.0).wait(poll_s=0.02)
    thread.join()
