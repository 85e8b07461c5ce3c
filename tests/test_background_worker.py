"""The one background-worker primitive (``moe_ft/background.py``) behind the snapshot engine, the durable
writer and the replication sender: order, the sticky error and how it surfaces, drain and close."""

from __future__ import annotations

import threading
import time

import pytest

from moe_ft.background import BackgroundWorker


def _worker(handle, **kw):
    return BackgroundWorker("test-worker", handle, describe=lambda e: f"worker failed: {e!r}", **kw)


def test_items_are_handled_in_order_on_one_named_daemon_thread():
    seen, names = [], set()

    def handle(item):
        seen.append(item)
        names.add((threading.current_thread().name, threading.current_thread().daemon))

    w = _worker(handle)
    for i in range(50):
        w.submit(i)
    w.drain()
    assert seen == list(range(50)) and names == {("test-worker", True)}
    w.close()
    assert not w.alive


def test_the_first_error_is_kept_later_items_are_skipped_and_every_call_raises_it():
    seen, after = [], []

    def handle(item):
        if item == 2:
            raise OSError("disk full")
        seen.append(item)

    w = _worker(handle, after=lambda item, err: after.append((item, type(err).__name__ if err else None)))
    for i in range(5):
        w.submit(i)
    with pytest.raises(RuntimeError, match=r"worker failed: OSError\('disk full'\)") as info:
        w.drain()
    assert isinstance(info.value.__cause__, OSError)
    assert seen == [0, 1]  # 3 and 4 were drained, not handled
    assert after == [(0, None), (1, None), (2, "OSError"), (3, "OSError"), (4, "OSError")]
    with pytest.raises(RuntimeError):
        w.raise_if_failed()
    w.close()  # stops the thread without raising; the error stays
    assert not w.alive and isinstance(w.error, OSError)


def test_close_handles_what_is_queued_and_setup_runs_first_on_the_thread():
    gate, seen = threading.Event(), []
    w = _worker(lambda item: (gate.wait(10), seen.append(item)), setup=lambda: seen.append("setup"))
    for i in range(3):
        w.submit(i)
    assert w.has_pending() or seen == ["setup"]  # item 0 may already be waiting on the gate
    gate.set()
    w.close(timeout=10)
    assert seen == ["setup", 0, 1, 2] and not w.has_pending()
    w.close()  # a second close is a no-op


def test_close_with_discard_finishes_the_item_in_hand_and_skips_the_queued_ones():
    """A failed attempt's work: what the thread is handling ends, what waits is never handled."""
    started, gate, seen = threading.Event(), threading.Event(), []
    w = _worker(lambda item: (started.set(), gate.wait(10), seen.append(item)))
    for i in range(3):
        w.submit(i)
    assert started.wait(10)  # item 0 is in hand
    w.close(timeout=0.01, discard=True)  # returns with item 0 still in hand
    assert w.alive
    gate.set()
    deadline = time.monotonic() + 10
    while w.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [0] and not w.alive and not w.has_pending()
    w.raise_if_failed()  # discarding is no error


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["setup", "after"])
def test_an_error_in_setup_or_after_is_kept_and_the_thread_still_drains(where):
    """An exception of ``setup`` or ``after`` is the worker's error as one of ``handle`` is: the thread lives on
    to skip the queued items, so ``drain`` raises it instead of waiting for items nobody takes (the thread
    died before, and the next drain never returned)."""
    handled = []

    def fail(*_):
        raise OSError("no room")

    w = _worker(handled.append, **({"setup": fail} if where == "setup" else {"after": fail}))
    for i in range(3):
        w.submit(i)
    with pytest.raises(RuntimeError, match="worker failed: OSError"):
        w.drain()
    assert handled == ([] if where == "setup" else [0]) and w.alive
    w.close(5)
    assert not w.alive
