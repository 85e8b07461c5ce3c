"""The worker's side of ``moe-ft launch``: spares wait for a rank, survivors join the next attempt in-process.

A training script calls :func:`join` once, after its imports and flag parsing and before any process
group exists. Under ``moe-ft launch`` a spare blocks there until the agent gives it a failed rank; then
it starts as a restarted rank would (recovery loads that rank's state). Every worker records its pid for
the attempt it joins, so a recovery report can say whether the survivors kept their processes.

After training raised, :meth:`Membership.rejoin` decides whether this process may continue: only under
``moe-ft launch`` (not with ``--full-restart``), and only when the error came from a peer (a collective
or point-to-point operation failed because another rank died or left its process groups). The caller has
already left its process groups; :meth:`rejoin` waits for the agent's next attempt and sets
``TORCHELASTIC_RESTART_COUNT`` to it, and the script builds its model, process groups and runtime again
in this process; recovery then runs exactly as after a restart. An error of the rank's own (an exception
in its code, a stop signal) ends the process, and the agent gives its rank to a spare.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from moe_ft.launch import protocol

PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error",
               "Broken pipe", "Connection refused", "NCCL communicator was aborted", "ProcessGroup")
"""Substrings of the messages of failed collectives (gloo and NCCL raise ``RuntimeError`` subclasses)."""


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says that a *peer* failed (this rank's own state is intact)."""
    import torch.distributed as dist  # start-up time: the launcher's CLI parses flags without torch

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in PEER_ERRORS)


@dataclass
class Membership:
    """This process's place in a ``moe-ft launch`` job (``store is None``: not under ``moe-ft launch``)."""

    store: Any = None
    keys: protocol.Keys | None = None
    attempt: int = 0
    rank: int = -1
    gave_up: bool = False
    """:meth:`rejoin` saw no new attempt in time, or the agents fell back to a full restart: exit with
    :data:`protocol.GAVE_UP_EXIT_CODE`."""
    regroup_seen: int = -1
    """The attempt whose ``regroup/<a>`` :meth:`watch` saw (a node joins)."""
    resized: bool = False
    """The attempt :meth:`rejoin` joined reshaped the job (this process may have a new rank)."""
    superseded: bool = False
    """The watch saw a newer attempt announced while this process was still in its own (and severed it)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the watch compares attempts and severs, and while :meth:`rejoin` moves to a new attempt
    (so that the watch never severs the new attempt's connections)."""

    @property
    def inprocess(self) -> bool:
        return self.store is not None

    @property
    def reforming(self) -> bool:
        """The current attempt re-forms the process groups of processes that outlived the one before (a
        survivor waits there at most ``--reform-timeout`` for the others). ``False`` in the job's first
        attempt and in a full restart (announced ``"job"``): every process starts afresh, imports included,
        and waits for the others as long as at a first start. An attempt without an announcement counts as a
        full restart, as in :func:`launch_facts`."""
        if self.store is None or self.keys is None or self.attempt == 0:
            return False
        return protocol.announcement(self.store, self.keys, self.attempt).get("kind", "job") != "job"

    def record_pid(self) -> None:
        if self.store is not None and self.keys is not None:
            self.store.set(self.keys.pid(self.attempt, self.rank), str(os.getpid()))

    def rejoin(self, error: str, from_peer: bool) -> bool:
        """After this rank's training raised (``error``: its message; ``from_peer``: :func:`peer_failure`)
        and it left its process groups: ``True`` when it joined the next attempt (train again in this
        process), ``False`` when it must exit."""
        if self.store is None or self.keys is None or not (from_peer or self.superseded):
            return False
        timeout = protocol.reform_timeout_s()
        attempt = protocol.wait_for_attempt_after(self.store, self.keys, self.attempt, timeout)
        if attempt is None:
            print(f"moe-ft launch: rank {self.rank} saw no new attempt within {timeout:.0f} s after: "
                  f"{error[:200]}; falling back to a full restart", file=sys.stderr, flush=True)
            self.gave_up = True
            return False
        info = protocol.announcement(self.store, self.keys, attempt)
        while info.get("kind") == "await" and self.rank not in info.get("failed", []):
            # a lost node's ranks wait for a replacement node: this process keeps its state and waits on
            wait_s = float(info.get("wait_s", timeout)) + timeout
            print(f"moe-ft launch: rank {self.rank} keeps its process and waits up to {wait_s:.0f} s for a "
                  f"replacement of node(s) {info.get('lost', [])} (attempt {attempt})", file=sys.stderr, flush=True)
            waited = protocol.wait_for_attempt_after(self.store, self.keys, attempt, wait_s)
            if waited is None:
                print(f"moe-ft launch: rank {self.rank} saw no replacement node within {wait_s:.0f} s; falling back "
                      "to a full restart", file=sys.stderr, flush=True)
                self.gave_up = True
                return False
            attempt, info = waited, protocol.announcement(self.store, self.keys, waited)
        # every attempt announced since this process's own, in order: one it skipped (a second failure
        # announced while it still held its state) may have shrunk the job or given its rank away
        rank, layout = self.rank, None
        for step in range(self.attempt + 1, attempt + 1):
            said = info if step == attempt else protocol.announcement(self.store, self.keys, step)
            if said.get("kind") == "await" and step != attempt:
                continue  # a wait for a replacement node that a later attempt ended
            if rank in said.get("failed", []) and "resize" not in said:  # given to another process
                print(f"moe-ft launch: rank {rank} was given to another process in attempt {step} (its node "
                      "was declared lost, or every worker started again): this process stops", file=sys.stderr,
                      flush=True)
                return False
            if said.get("kind") == "fallback":  # the agents cannot replace the failed ranks: all start again
                print(f"moe-ft launch: rank {rank} leaves for a full restart: {said.get('reason', '')}",
                      file=sys.stderr, flush=True)
                self.gave_up = True
                return False
            resize = said.get("resize")
            if resize is not None:  # the job was reshaped: this rank's new number
                if str(rank) not in resize["ranks"]:
                    print(f"moe-ft launch: rank {rank} is not in the shrunk job (attempt {step})", file=sys.stderr,
                          flush=True)
                    return False
                rank, layout = int(resize["ranks"][str(rank)]), int(resize["world_size"])
        self.resized = layout is not None
        if layout is not None:
            self.rank = rank
            _set_layout(rank, layout)
        with self.lock:
            self.attempt, self.superseded = attempt, False
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        self.record_pid()
        return True

    def stand_by(self, usable: int) -> None:
        """The global batch leaves this rank out of the attempt (``moe_ft/elastic/standby.py``): say so, its
        held state being in the node store already; the process then exits
        :data:`~moe_ft.launch.protocol.STANDBY_EXIT_CODE` and its agent starts a spare in its place."""
        if self.store is not None and self.keys is not None:
            self.store.set(self.keys.standby(self.attempt, self.rank), json.dumps({"usable": usable}))

    def wait_for_standbys(self, ranks: list[int], timeout_s: float) -> bool:
        """Wait until the ranks the global batch leaves out of this attempt have written their held state
        (:meth:`stand_by`); ``False`` after ``timeout_s`` (their points are then missing from the node stores
        and the reshape uses what is there)."""
        if self.store is None or self.keys is None:
            return True
        keys = [self.keys.standby(self.attempt, r) for r in ranks]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                print(f"moe-ft launch: rank {self.rank}: ranks {ranks} did not stand by within {timeout_s:.0f} s",
                      file=sys.stderr, flush=True)
                return False
            time.sleep(0.02)
        return True

    def mark_done(self) -> None:
        """Rank 0, training ended: agents left with spares only (their workers stood by) finish too."""
        if self.store is not None and self.keys is not None:
            self.store.set(self.keys.done, "1")

    def regroup_requested(self) -> bool:
        """The agents asked this attempt's workers to leave it because a node joins (seen by
        :meth:`watch`); every rank agrees on the iteration at whose end they leave (``FTRuntime.after_log``)."""
        return self.regroup_seen == self.attempt

    def suspect(self) -> None:
        """A collective failed because a peer died: tell the agents (they declare a silent node lost sooner)."""
        if self.store is not None and self.keys is not None:
            with contextlib.suppress(Exception):  # best effort: the store may be unreachable too
                self.store.add(self.keys.suspect(self.attempt), 1)

    def watch(self, poll_s: float = protocol.WATCH_POLL_S) -> None:
        """Start the agent's notice: a daemon thread that severs this process's connections (as after a
        failed collective) as soon as an attempt newer than its own is announced. A process can wait on a
        peer that will never answer without a collective failing: forming an attempt's groups (blocked in
        the store on a rank that died meanwhile), or waiting for a survivor that itself waits. The
        announcement ends those waits at once instead of after ``--reform-timeout``."""
        if self.store is None or self.keys is None:
            return
        keys = self.keys
        grows = bool(os.environ.get(protocol.GROWS_ENV))
        store = _client(timeout_s=60)  # its own connection: the main thread uses self.store meanwhile
        _KEPT.update(_endpoints())
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(poll_s):
                try:
                    attempt = self.attempt
                    newest = protocol.current_attempt(store, keys)
                    regroup = grows and store.check([keys.regroup(attempt)])
                except Exception:  # noqa: BLE001 - the store is gone: the agent ends this process anyway
                    return
                if regroup:
                    self.regroup_seen = attempt
                with self.lock:
                    # a node joins: every worker leaves at the end of an iteration they agree on instead
                    if newest > self.attempt and not regroup:
                        # and again at every poll until this process moved on: a connection made since (a
                        # store client's constructor retries its connect when its handshake was severed)
                        # would otherwise wait out the re-form timeout for peers of the old attempt
                        sever_peer_connections(devices=not self.superseded)
                        self.superseded = True

        thread = threading.Thread(target=run, name="moe-ft-attempt-watch", daemon=True)
        thread.start()

        def end() -> None:  # not inside a store call when the interpreter exits
            stop.set()
            thread.join(5)

        atexit.register(end)


_KEPT: set = set()
"""TCP connections never severed: those this process had when it joined (a forked worker inherits its
launcher's, e.g. the rendezvous keep-alive), and its own two to the launch store (:func:`join`,
:meth:`Membership.watch`). Every other connection belongs to an attempt's process groups or their stores."""


def _tcp_connections():
    import psutil  # start-up time: only launched workers look at their connections

    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd >= 0]


def _endpoints() -> set:
    return {(c.laddr, c.raddr) for c in _tcp_connections()}


def _client(timeout_s: float):
    import torch.distributed as dist  # start-up time: only launched workers reach the store

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def sever_peer_connections(devices: bool = True) -> int:
    """Shut down every TCP connection of this process except the kept ones (:data:`_KEPT`); returns how
    many. Called when a peer failed, before this process leaves the attempt's process groups, and when a
    newer attempt is announced (:meth:`Membership.watch`).

    Why: gloo in torch 2.13 has no way to end an operation already waiting (``ProcessGroupGloo.abort()``
    and ``shutdown()`` return at once and leave a blocked ``recv`` or ``allreduce`` blocked, measured), and a
    group's connections close only when the last Python reference to it is collected. A rank waiting on
    a survivor (not on the dead rank) would wait until the group's timeout. Shutting the connections down
    (not closing the descriptors: their owners still hold them) makes every pending and future operation
    of the failed attempt fail at once, here and on the peers at the other end, which then leave too.
    The attempt's connections to the store go too (a wait there for a rank that died ends). The next
    attempt's groups connect afresh. ``devices``: abort the NCCL communicators too (the notice's first
    sever; its later ones, at every poll until the process rejoins, only shut down connections made since)."""
    count = 0
    for conn in _tcp_connections():
        if (conn.laddr, conn.raddr) in _KEPT:
            continue  # the launcher's, or this process's own to the launch store
        try:
            sock = socket.socket(fileno=conn.fd)
        except OSError:  # closed since it was listed
            continue
        try:
            with contextlib.suppress(OSError):  # already shut down by the other end
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        finally:
            sock.detach()  # the descriptor stays open, owned by gloo
    if devices:
        abort_device_communicators()
    return count


def abort_device_communicators() -> int:
    """Abort this process's NCCL communicators (returns how many): device collectives do not wait on a TCP
    connection, so severing does not end them; an aborted communicator fails its pending and future work,
    and the thread waiting on it raises. Safe from the notice thread: only the backends are aborted, the
    groups stay registered until the main thread leaves them (``megatron.training.initialize.shutdown``).
    Nothing to do without CUDA.

    The aborts run side by side, one thread per backend: on an H200 (NCCL 2.28.9) one abort of a live
    communicator takes 0.5-1.0 s; six took 3.5 s one after another, 1.0 s side by side, and 5.9 s through
    torch's ``_abort_process_group`` (docs/benchmarks.md, "In-process recovery on one GPU")."""
    import torch  # start-up time: the launcher's CLI parses flags without torch
    import torch.distributed as dist  # start-up time, as above

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return 0
    backends = []
    for group in list(dist.distributed_c10d._world.pg_names):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # a host-only group (gloo)
            continue
        if type(backend).__name__ == "ProcessGroupNCCL":
            backends.append(backend)

    def abort(backend) -> bool:
        try:
            backend.abort()
            return True
        except Exception:  # noqa: BLE001 - already aborted by its watchdog
            return False

    if not backends:
        return 0
    with ThreadPoolExecutor(max_workers=len(backends), thread_name_prefix="moe-ft-nccl-abort") as pool:
        return sum(pool.map(abort, backends))


def _set_layout(rank: int, world_size: int, group_rank: int | None = None) -> None:
    """This process's place in the job, as torch elastic's environment variables."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.update(RANK=str(rank), ROLE_RANK=str(rank), WORLD_SIZE=str(world_size),
                      ROLE_WORLD_SIZE=str(world_size), GROUP_WORLD_SIZE=str(world_size // per_node),
                      GROUP_RANK=str(rank // per_node if group_rank is None else group_rank))


def _warm_device_runtime() -> None:
    """A spare's device work that does not depend on the rank it will take: the CUDA runtime's start (the
    driver, the device count). No context is created on any device: a spare holds no device memory while it
    waits. Nothing to do without CUDA."""
    import torch  # start-up time: the launcher's CLI parses flags without torch

    if torch.cuda.is_available():
        torch.cuda.init()


def _check_device(index: int) -> None:
    """A spare given a device index its node does not have exits with the usage code (the agent then
    restarts the job and says why) instead of failing in ``torch.cuda.set_device``. It happens when a spare
    takes a rank of another node (its own device index is used: a rank of its own node gives it that
    rank's device) on a node with fewer GPUs than ``--nproc-per-node`` + ``--spares-per-node``."""
    import torch  # start-up time: the launcher's CLI parses flags without torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else None
    if count is not None and index >= count:
        print(f"moe-ft launch: this spare was given device {index} but its node has {count} GPU(s): a spare that "
              "takes a rank of another node needs a GPU of its own; give every node --nproc-per-node + "
              "--spares-per-node GPUs", file=sys.stderr, flush=True)
        sys.exit(protocol.USAGE_EXIT_CODE)


def join() -> Membership:
    """At process start. Outside ``moe-ft launch``: an inert membership. A spare blocks here until it is
    given a rank (``RANK``, ``LOCAL_RANK`` and ``TORCHELASTIC_RESTART_COUNT`` are set from the assignment)."""
    run_id = os.environ.get(protocol.RUN_ENV)
    if not run_id:
        return Membership()
    store = _client(timeout_s=300)
    _KEPT.update(_endpoints())  # inherited ones, and this store's
    keys = protocol.Keys(run_id)
    slot = os.environ.pop(protocol.SPARE_ENV, None)
    if slot:
        _warm_device_runtime()
        assignment = protocol.wait_for_assignment(store, keys, slot)
        _check_device(int(assignment["local_rank"]))
        os.environ.update(LOCAL_RANK=str(assignment["local_rank"]), TORCHELASTIC_RESTART_COUNT=str(assignment["attempt"]))
        _set_layout(assignment["rank"], assignment.get("world_size", int(os.environ["WORLD_SIZE"])),
                    assignment.get("group_rank", int(os.environ.get("GROUP_RANK", "0"))))
    membership = Membership(store, keys, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                            rank=int(os.environ["RANK"]))
    membership.record_pid()
    membership.watch()
    return membership


def pids_kept(store, keys: protocol.Keys, attempt: int, world_size: int) -> bool | None:
    """Whether every rank the agent did not replace in ``attempt`` kept the pid it had when it last joined
    an attempt before (``None``: not an in-process attempt). Two failures close together can announce two
    attempts before a survivor rejoins: it then joins only the newer one, so the pid it is compared with is
    its latest recorded one; a rank replaced in one of the attempts it skipped was not kept."""
    info = protocol.announcement(store, keys, attempt)
    if info.get("kind") != "inprocess":
        return None
    failed = set(info.get("failed", []))
    if "resize" in info:  # a shrink: the survivors' numbers changed
        moved = [(int(old), new) for old, new in info["resize"]["ranks"].items()]
        return all(_same_pid(store, keys.pid(attempt - 1, old), keys.pid(attempt, new)) for old, new in moved)
    for rank in range(world_size):
        if rank in failed:
            continue
        before = attempt - 1
        while before > 0 and not store.check([keys.pid(before, rank)]):
            skipped = protocol.announcement(store, keys, before)
            if "resize" in skipped or rank in skipped.get("failed", []):
                return False
            before -= 1
        if not _same_pid(store, keys.pid(before, rank), keys.pid(attempt, rank)):
            return False
    return True


def _same_pid(store, before: str, after: str) -> bool:
    return store.check([before, after]) and store.get(before) == store.get(after)


def launch_facts(world_size: int) -> dict | None:
    """This attempt as ``moe-ft launch`` announced it: ``{"kind", "pids_kept", "detected_at"}``; ``None``
    outside ``moe-ft launch`` or for its first attempt."""
    run_id = os.environ.get(protocol.RUN_ENV)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not run_id or attempt == 0:
        return None
    store = _client(timeout_s=60)
    keys = protocol.Keys(run_id)
    info = protocol.announcement(store, keys, attempt)
    return {"kind": info.get("kind", "job"), "pids_kept": pids_kept(store, keys, attempt, world_size),
            "detected_at": info.get("detected_at"), "reason": info.get("reason", "")}
