"""Log-fed replay (MoEvement §3.4, App. A): a set of replaying ranks (the failed stages' data-parallel
groups) runs ``train_step`` for the iterations it lost while every other rank stays where it is.

* :func:`exchange_logs` (collective, host path): the ranks that do not replay send the log entries the
  replayers need — the activations their downstream neighbour receives, the gradients their upstream
  neighbour receives, the results of collectives on groups that span stages — from their node-local logs,
  point to point over the coordination gloo group (no assumption that holder and replayer share a node).
  Every rank computes the same transfer plan from the gathered inventories, so a missing or corrupt entry
  raises the same :class:`~moe_ft.localized.log_store.LogUnavailable` on every rank (the caller then
  falls back to a global replay).
* :class:`LogReplay` (context manager, explicit state): under it, a replaying rank's p2p receives from
  non-replaying ranks are filled from the fetched logs, its sends to them are dropped, collectives on
  groups that include a non-replaying rank are served from the collective log (the same bytes the
  fault-free run received), and everything among replaying ranks (the stage's EP all-to-alls, DP reduces,
  the boundary between two adjacent replaying stages) runs for real.

Usage on a replaying rank (``seams``: the component's :class:`LogSeams`)::
    feed = exchange_logs(log_dir, replaying=ranks, iterations=range(k, n))     # every rank
    with LogReplay(seams, feed, replaying=ranks, rank=rank) as replay:        # replaying ranks only
        for t in range(k, n):
            with replay.iteration(t):
                train_step(state, data, t, args)
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.localized.collective_log import CollectiveSeam, serve
from moe_ft.localized.log_store import (
    BWD,
    FWD,
    CorruptLogEntry,
    LogDir,
    LogUnavailable,
    MissingLogEntry,
    decode_blob,
    decode_entry,
)
from moe_ft.localized.upstream_log import P2PSeam
from moe_ft.localized.vstages import comm_layout, sending_vstage

_SEND = re.compile(r"^send\.(fwd|bwd)\.to(\d+)$")
_COLL = re.compile(r"^coll\.([\d-]+)$")


@dataclass
class LogSeams:
    """The two seams the capture and the replay attach to (installed by the runtime component)."""

    p2p: P2PSeam
    collectives: CollectiveSeam


@dataclass
class LogFeed:
    """The log entries the replaying ranks need, in host memory (what :func:`exchange_logs` fetched)."""

    sends: dict[tuple[int, int, str, int], list] = field(default_factory=dict)
    """(iteration, sender, direction, receiver) → ``[(vstage, tensor)]`` in send order."""
    collectives: dict[tuple[int, tuple[int, ...]], list] = field(default_factory=dict)
    """(iteration, group ranks) → ``[CollectiveResult]`` in call order."""
    nbytes: int = 0
    """Entry bytes received (transport volume)."""

    def add(self, iteration: int, sender: int, name: str, decoded) -> None:
        m = _SEND.match(name)
        if m:
            self.sends[(iteration, sender, m.group(1), int(m.group(2)))] = decoded
        else:
            self.collectives[(iteration, tuple(int(r) for r in _COLL.match(name).group(1).split("-")))] = decoded


class LogReplay:
    """Replay under logs on a replaying rank (module docstring). ``recorder``: a ``LogRecorder`` that logs
    the replayed iterations again (their sends, the served and the real collective results), so that the
    replayed stage can serve a later recovery of its neighbours."""

    def __init__(self, seams: LogSeams, feed: LogFeed, *, replaying: Iterable[int], rank: int, recorder=None) -> None:
        self.seams, self.feed, self.rank, self.recorder = seams, feed, rank, recorder
        self.replaying = frozenset(replaying)
        if rank not in self.replaying:
            raise ValueError(f"rank {rank} is not in the replaying set {sorted(self.replaying)}: only replaying "
                             "ranks enter LogReplay (the others serve logs through exchange_logs)")
        self.current: int | None = None
        self._taken: dict = {}
        self._layout: tuple[int, int, int, int] | None = None
        """(pp_size, chunks, group size, pp rank) of the communicator being served (virtual stages only)."""
        self._thread: int | None = None

    @property
    def active(self) -> bool:
        """Calls on the thread that entered the replay are replayed; other threads' pass through."""
        return threading.get_ident() == self._thread

    def __enter__(self) -> "LogReplay":
        if self.seams.p2p.replay is not None or self.seams.collectives.replay is not None:
            raise RuntimeError("another LogReplay is active on these seams")
        self._thread = threading.get_ident()
        self.seams.p2p.replay = self
        self.seams.collectives.replay = self
        self._saved_recorder = (self.seams.p2p.recorder, self.seams.collectives.recorder)
        self.seams.p2p.recorder = self.seams.collectives.recorder = self.recorder
        return self

    def __exit__(self, *exc) -> None:
        self.seams.p2p.replay = self.seams.collectives.replay = None
        self.seams.p2p.recorder, self.seams.collectives.recorder = self._saved_recorder

    @contextlib.contextmanager
    def iteration(self, iteration: int):
        """Replay ``iteration`` in this block; at its end every fetched entry of it must have been used."""
        self.current, self._taken = iteration, {}
        if self.recorder is not None:
            self.recorder.begin(iteration)
        try:
            yield self
            self._check_consumed(iteration)
        except BaseException:
            if self.recorder is not None:
                self.recorder.abandon()
            raise
        finally:
            self.current = None
        if self.recorder is not None:
            self.recorder.end()

    def _check_consumed(self, t: int) -> None:
        left = [f"{d} from rank {s} ({len(v) - self._taken.get(('p2p', s, d), 0)} of {len(v)})"
                for (it, s, d, r), v in self.feed.sends.items()
                if it == t and r == self.rank and self._taken.get(("p2p", s, d), 0) != len(v)]
        if left:
            raise LogUnavailable(f"rank {self.rank} iteration {t}: logged sends not consumed by the replay: "
                                 f"{', '.join(left)}; the replay diverged from the logged schedule (same "
                                 "micro-batches and pipeline layout?); replay globally (--ft-recovery-scope global)")

    def _take(self, sender: int, direction: str) -> torch.Tensor:
        t = self.current
        if t is None:
            raise RuntimeError("LogReplay: p2p outside replay.iteration(t); wrap each replayed train_step")
        seq = self.feed.sends.get((t, sender, direction, self.rank))
        idx = self._taken.get(("p2p", sender, direction), 0)
        if seq is None or idx >= len(seq):
            raise MissingLogEntry(f"rank {self.rank} iteration {t}: no logged {direction} send #{idx} from rank "
                                  f"{sender} (entry send.{direction}.to{self.rank} of rank {sender}'s upstream log); "
                                  "replay globally (--ft-recovery-scope global)")
        self._taken[("p2p", sender, direction)] = idx + 1
        self._check_vstage(sender, direction, idx, seq[idx][0])
        return seq[idx][1]

    def _check_vstage(self, sender: int, direction: str, idx: int, logged: int) -> None:
        """With virtual pipeline stages, the ``idx``-th logged send must come from the chunk the schedule runs
        there (``moe_ft/localized/vstages.py``): capture and replay agree on the key, not only on the order."""
        layout = self._layout
        if layout is None or logged < 0:
            return
        pp_size, num_chunks, group, pp_rank = layout
        sender_pp = (pp_rank - 1) % pp_size if direction == FWD else (pp_rank + 1) % pp_size
        expected = sending_vstage(pp_rank=sender_pp, pp_size=pp_size, num_chunks=num_chunks, group_size=group,
                                  direction=direction, send_idx=idx)
        if logged != expected:
            raise LogUnavailable(f"rank {self.rank} iteration {self.current}: logged {direction} send #{idx} from rank "
                                 f"{sender} came from virtual stage {logged}, the replayed schedule expects virtual "
                                 f"stage {expected} (different virtual pipeline layout or micro-batch count?); "
                                 "replay globally (--ft-recovery-scope global)")

    @staticmethod
    def _received(logged: torch.Tensor, shape, dtype) -> torch.Tensor:
        """A fresh receive buffer (as Megatron allocates it: ``requires_grad``) holding the logged bytes."""
        if shape is not None and tuple(logged.shape) != tuple(shape) or logged.dtype != dtype:
            raise LogUnavailable(f"logged tensor {tuple(logged.shape)} {logged.dtype} does not match the receive "
                                 f"of {tuple(shape)} {dtype}: the pipeline layout or micro-batch shape changed; "
                                 "replay globally (--ft-recovery-scope global)")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        out = torch.empty(logged.shape, dtype=dtype, device=device, requires_grad=True)
        with torch.no_grad():
            out.copy_(logged)
        return out

    # ------------------------------------------------------------------------------- seam handlers
    def communicate(self, comm, real, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                    wait_on_reqs=True):
        live_next, live_prev = comm.next_rank in self.replaying, comm.prev_rank in self.replaying
        part = dict(tensor_send_next=tensor_send_next if live_next else None,
                    tensor_send_prev=tensor_send_prev if live_prev else None,
                    recv_prev=recv_prev and live_prev, recv_next=recv_next and live_next)
        if part["tensor_send_next"] is not None or part["tensor_send_prev"] is not None or part["recv_prev"] \
                or part["recv_next"]:
            got_prev, got_next, reqs = real(**part, tensor_shape=tensor_shape, wait_on_reqs=wait_on_reqs)
        else:
            cfg = comm.config
            got_prev = got_next = None
            reqs = None if wait_on_reqs else ([] if cfg.use_ring_exchange_p2p or cfg.batch_p2p_comm else {})
        dtype = comm.config.pipeline_dtype
        layout = comm_layout(comm)
        self._layout = None if layout is None else (*layout, comm.pp_group.rank())
        if recv_prev and not live_prev:
            got_prev = self._received(self._take(comm.prev_rank, FWD), tensor_shape, dtype)
        if recv_next and not live_next:
            got_next = self._received(self._take(comm.next_rank, BWD), tensor_shape, dtype)
        return got_prev, got_next, reqs

    def collective(self, ranks: tuple[int, ...], fn: str, outputs: list[torch.Tensor], call, spans: bool):
        if self.replaying.issuperset(ranks):
            return call()  # every member replays: the collective runs for real
        t = self.current
        if t is None:
            raise RuntimeError(f"LogReplay: {fn} on group {list(ranks)} outside replay.iteration(t)")
        if not spans:
            raise ValueError(f"{fn} on group {list(ranks)} lies within one pipeline stage but includes ranks that do "
                             f"not replay ({sorted(set(ranks) - self.replaying)}): replay every rank of a stage "
                             "together (the stage's whole data-parallel group)")
        idx = self._taken.get(("coll", ranks), 0)
        calls = self.feed.collectives.get((t, ranks))
        where = f"rank {self.rank} iteration {t} group {list(ranks)} call #{idx} ({fn})"
        if calls is None or idx >= len(calls):
            raise MissingLogEntry(f"{where}: not in the collective log (entry coll.{'-'.join(map(str, ranks))} of the "
                                  "group's surviving members); replay globally (--ft-recovery-scope global)")
        self._taken[("coll", ranks)] = idx + 1
        return serve(fn, outputs, calls[idx], where)


# ------------------------------------------------------------------------------------------ exchange
def _inventory(log_dir: LogDir, replaying: frozenset, iterations: list[int], rank: int):
    """What this (non-replaying) rank can serve: {(t, name): (size, checksum, algo)}, the bytes, problems."""
    offers, blobs, problems = {}, {}, []
    for t in iterations:
        try:
            names = log_dir.entry_names(t)
        except MissingLogEntry:
            continue  # reported by the plan if someone needs it
        except CorruptLogEntry as e:
            problems.append(str(e))
            continue
        for name in names:
            m, c = _SEND.match(name), _COLL.match(name)
            wanted = (m and int(m.group(2)) in replaying) or (
                c and any(int(r) in replaying for r in c.group(1).split("-")))
            if not wanted:
                continue
            try:
                data, rec = log_dir.read_raw(t, name)
            except LogUnavailable as e:
                problems.append(f"rank {rank}: {e}")
                continue
            offers[(t, name)] = (rec["size"], rec["checksum"], rec["algo"])
            blobs[(t, name)] = data
    return offers, blobs, problems


def plan_transfers(inventories: list, replaying: frozenset, iterations: list[int]):
    """The transfer plan every rank computes from the gathered inventories (pure: no communication).

    ``inventories[rank]``: ``{"offers": {(t, name): (size, checksum, algo)}, "problems": [str],
    "pipeline_ranks": [global ranks in stage order]}``. Returns the transfers ``(src, dst, t, name, size,
    checksum, algo)`` sorted in one global order, the missing entries and the verification problems."""
    transfers, missing, problems = [], [], []
    for inv in inventories:
        problems += inv["problems"]
    servers: dict = {}
    for src, inv in enumerate(inventories):
        if src in replaying:
            continue
        for (t, name), rec in sorted(inv["offers"].items()):
            m = _SEND.match(name)
            if m:
                transfers.append((src, int(m.group(2)), t, name, *rec))
            else:  # one serving member per (iteration, group): the lowest rank that has it
                servers.setdefault((t, name), (src, rec))
    for (t, name), (src, rec) in sorted(servers.items()):
        members = [int(r) for r in _COLL.match(name).group(1).split("-")]
        transfers += [(src, dst, t, name, *rec) for dst in members if dst in replaying]
    have = {(src, t, name) for src, _, t, name, *_ in transfers}
    groups = {name for _, name in servers}  # a stage-spanning group logged in one iteration is in all of them
    missing += [f"no surviving member of group {name[5:]} has its collective log of iteration {t}"
                for name in sorted(groups) for t in iterations if (t, name) not in servers]
    for dst in sorted(replaying):
        pp = inventories[dst]["pipeline_ranks"]
        stage = pp.index(dst)
        need = ([(pp[stage - 1], FWD)] if stage > 0 else []) + ([(pp[stage + 1], BWD)] if stage + 1 < len(pp) else [])
        for src, direction in need:
            if src in replaying:
                continue
            for t in iterations:
                if (src, t, f"send.{direction}.to{dst}") not in have:
                    missing.append(f"rank {src} has no upstream log entry send.{direction}.to{dst} of iteration {t}")
    return sorted(transfers, key=lambda x: (x[0], x[1], x[2], x[3])), missing, problems


def exchange_logs(log_dir: LogDir, *, replaying: Iterable[int], iterations: Iterable[int],
                  pipeline_ranks: Sequence[int] | None = None, group=None) -> LogFeed:
    """Move the log entries the replaying ranks need for ``iterations`` from the ranks that hold them.

    Collective over every rank of the job (host path: ``group`` defaults to the coordination gloo group).
    ``pipeline_ranks``: this rank's pipeline-parallel group in stage order (default: Megatron's). Returns the
    fetched entries on a replaying rank, an empty :class:`LogFeed` elsewhere. Raises
    :class:`MissingLogEntry` / :class:`CorruptLogEntry` on every rank alike when a needed entry is missing or
    any offered entry fails its checksum (the message names the holder, the entry and the iteration).

    A :class:`LogReplay` error raised later (the replay diverged, a collective nobody logged) is raised on
    the replaying ranks only: the caller agrees on the outcome over all ranks before falling back."""

    group = group if group is not None else comm.coordination_group()
    rank = dist.get_rank()
    replaying, its = frozenset(replaying), sorted(iterations)
    if not its or not replaying:  # the same arguments on every rank: every rank returns here alike
        return LogFeed()
    if pipeline_ranks is None:
        pipeline_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    offers, blobs, problems = ({}, {}, []) if rank in replaying else _inventory(log_dir, replaying, its, rank)
    inventories = comm.all_gather_object({"offers": offers, "problems": problems,
                                          "pipeline_ranks": list(pipeline_ranks)}, group=group)
    transfers, missing, problems = plan_transfers(inventories, replaying, its)
    if problems:
        raise CorruptLogEntry(f"{len(problems)} upstream log entries failed verification, first: {problems[0]}")
    if missing:
        raise MissingLogEntry(f"localized replay of ranks {sorted(replaying)} over iterations {its[0]}..{its[-1]} "
                              f"lacks {len(missing)} log entries, first: {missing[0]} (dropped by retention or "
                              "lost with its node): fall back to a global replay (--ft-recovery-scope global)")
    feed = LogFeed()
    pairs: dict = {}
    for tr in transfers:
        pairs.setdefault((tr[0], tr[1]), []).append(tr)
    for (src, dst), items in sorted(pairs.items()):  # one global order: no send/recv deadlock
        if rank == src:
            payload = torch.frombuffer(bytearray(b"".join(blobs[(t, name)] for _, _, t, name, *_ in items)), dtype=torch.uint8)
            dist.send(payload, dst, group=group)
        elif rank == dst:
            payload = torch.empty(sum(it[4] for it in items), dtype=torch.uint8)
            dist.recv(payload, src, group=group)
            data, pos = payload.numpy().tobytes(), 0
            for _, _, t, name, size, checksum, algo in items:
                tensors, meta = decode_blob(data[pos:pos + size], checksum=checksum, algo=algo,
                                            key={"iteration": t, "entry": name},
                                            where=f"rank {src}'s upstream log, iteration {t} {name} (as received)")
                feed.add(t, src, name, decode_entry(name, tensors, meta))
                pos += size
            feed.nbytes += pos
    return feed
