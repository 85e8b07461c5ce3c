"""The processes of a drill's simulated nodes: kill a node's whole tree, dump its workers' stacks first, tell
its workers from ``multiprocessing``'s helpers, and whether a process lives or has SIGTERM pending
(``cluster.py`` plays the node losses with them; the tests stop what they started with them)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Sequence

import psutil

from moe_ft.drills.faults import resource_tracker


def kill_tree(pid: int, also: Sequence[int] = ()) -> None:
    """SIGKILL a process and everything below it (torchrun's workers run in sessions of their own) but
    ``multiprocessing``'s resource trackers (``faults.resource_tracker``: they clean up and exit), and the
    processes ``also`` (listed below it earlier: a worker whose fork server died since is no longer below)."""

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    pids = {p.pid for p in procs}
    for extra in also:
        if extra not in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(extra))
    for p in procs:
        if resource_tracker(p):
            continue
        with contextlib.suppress(psutil.NoSuchProcess):  # already gone
            p.kill()


def dump_stacks_then_kill(pid: int, wait_s: float = 2.0) -> None:
    """A drill that timed out: ask every process below ``pid`` for its threads' stacks (SIGUSR1; the
    training script's workers print them into the job's log, ``pretrain_gpt_moe.py``), then :func:`kill_tree`.
    A fork server gets no SIGUSR1 (it has no handler: it would die and orphan its workers)."""
    tree = children(pid)
    for child in workers(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGUSR1)
    time.sleep(wait_s)
    kill_tree(pid, also=tree)


def children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def workers(agent_pid: int) -> list[int]:
    """The worker processes below an agent: every descendant but multiprocessing's helpers (preloaded
    launchers fork their workers from a fork server, which starts a resource tracker; both live as long as
    their agent, across restarts). A helper is a child of the agent: the resource tracker has its own
    command line, the fork server is a fork of the agent (``moe_ft/drills/prelaunch.py``) and has the
    agent's; their forks (the workers) inherit those command lines, so only the agent's direct children are
    tested."""
    try:
        agent = psutil.Process(agent_pid)
        direct, own = agent.children(), agent.cmdline()
    except psutil.NoSuchProcess:
        return []
    helpers = set()
    for p in direct:
        with contextlib.suppress(psutil.NoSuchProcess):
            line = p.cmdline()
            if line == own or any(helper in part for part in line for helper in _HELPERS):
                helpers.add(p.pid)
    return [pid for pid in children(agent_pid) if pid not in helpers]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits for delivery to ``pid`` (a stopped process keeps it pending; Linux
    ``/proc/<pid>/status`` ``SigPnd``/``ShdPnd`` masks, signal n is bit n-1)."""

    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return any(int(line.split()[1], 16) & bit for line in lines if line.startswith(("SigPnd:", "ShdPnd:")))
