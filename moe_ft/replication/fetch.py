"""Recovery with a lost node (MoEtion §5.1, MoEvement §3.2): a restarted rank whose
node-local store is empty (its node was replaced) gets its entries back from the peers before recovery.

Where an entry of rank ``r`` at iteration ``t`` can come from, in order of preference:

1. a **replica holder** of ``r`` (whichever rank's inventory lists replicas of ``r``, wherever placement put
   them): the replica store it keeps for ``r``;
2. for state the replication deliberately did not send because data parallelism already keeps it on
   another node (``needs_replication``, MoEtion §5.1): the **node-local store of a data-parallel peer**
   (the expert-data-parallel group for experts) — COMPUTE weights always, FULL entries only without the
   distributed optimizer (which shards masters and moments, so a peer's FULL is a different shard).

The plan (:func:`plan_fetch`) is a pure function of the inventories every rank publishes (one
``all_gather_object``), so every rank computes the same transfers without further talk. Each entry goes to
the least-loaded eligible source (bytes so far), which spreads one rank's transfers over all its holders.
Holders keep the owner's manifest with each replica point (``OWNER_MANIFEST``), so the plan knows every
entry the owner had — a sparse point holds only some operators — and a point is fetched only if each of
them has a source; otherwise it is left out with the reason. Transfers run on a dedicated gloo group (one receiving thread per source, sends
on the calling thread, so no pair can deadlock); every entry is verified against the *owner's* checksum (a data-parallel
peer's copy must be the very bytes the owner had) before the point is published, atomically and under the
owner's own manifest, into the rank's node-local store. Recovery then proceeds exactly as after a worker crash (``moe_ft/recovery``).

The same step **completes** a rank's own points (``--ft-optimizer-recompute-local compute``, MoEtion §5.2):
FULL entries the owner only hashed, which its peers rebuilt from gradients, are holes in its store; each is
fetched from the least-loaded holder whose replica point has it (or an expert-data-parallel peer's own
store), verified against the owner's checksum and added to the point (``SnapshotStore.add_blob``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from moe_ft import comm
from moe_ft.replication.receiver import OWNER_MANIFEST, verify_message
from moe_ft.replication.transport import GlooTransport, GlooTransportConfig, PointMessage, Transport
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore
from moe_ft.store.backend import MANIFEST
from moe_ft.store.errors import CorruptEntryError
from moe_ft.store.manifest import decode_manifest

logger = logging.getLogger("moe_ft.replication")

META = "meta"
REPLICA, PEER = "replica", "peer"


# ------------------------------------------------------------------------------------------- inventory
@dataclass(kw_only=True)
class PointInventory:
    """The verified entries of one published point: ``entries[op] = (level name, blob, nbytes)``; ``op`` is
    the operator's string id or ``"meta"``. For a replica point, ``owner`` lists the same for every entry
    the *owner* had (its manifest, kept with the replica), deduplicated ones included."""

    entries: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    owner: dict[str, tuple[str, str, int]] | None = None
    missing: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    """Remote FULL entries the point lists but does not hold (``--ft-optimizer-recompute-local compute``:
    the replica peers rebuilt them); recovery fetches them into the point (:func:`plan_fetch`)."""


@dataclass(kw_only=True)
class Inventory:
    """What one rank can serve and needs (exchanged with ``all_gather_object``; plain data only)."""

    rank: int
    local: dict[int, PointInventory]
    """Points of its node-local store."""
    replicas: dict[int, dict[int, PointInventory]]
    """``replicas[owner][t]``: replica points it holds for ``owner``."""


def _entries(records) -> dict[str, tuple[str, str, int]]:
    return {META if e.op is None else str(e.op): ("" if e.level is None else e.level.name, e.blob, e.nbytes)
            for e in records}


def inventory_of(store: SnapshotStore, *, replica: bool = False) -> dict[int, PointInventory]:
    """The published points of ``store`` with the entries whose bytes match their checksums (a damaged
    manifest or entry is left out with the store's warning, so the plan takes another source). With
    ``replica``, also the owner's manifest kept with each replica point (``None`` if missing or damaged)."""
    out: dict[int, PointInventory] = {}
    catalog = store.verify()
    holes = catalog.holes
    for point in catalog.points():
        it = point.iteration
        owner = None
        if replica:
            try:
                data = store.backend.read_blob(it, OWNER_MANIFEST)
                owner = _entries(decode_manifest(data, it, f"{store.backend.describe()} {OWNER_MANIFEST}").all_entries())
            except (FileNotFoundError, CorruptEntryError) as exc:
                logger.warning("moe-ft replica %s iteration %d: owner manifest unusable (%s)",
                               store.backend.describe(), it, getattr(exc, "reason", exc))
        catalog_holes = {op for t, op in holes if t == it}
        out[it] = PointInventory(entries=_entries(e for e in point.all_entries() if e.op not in catalog_holes),
                                 owner=owner,
                                 missing=_entries(e for e in point.all_entries() if e.op in catalog_holes))
    return out


# ------------------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``dst`` the blobs ``blobs`` of ``src``'s point ``iteration`` (its node-local store when
    ``kind == "peer"``, its replica store of ``dst`` when ``kind == "replica"``)."""

    src: int
    dst: int
    iteration: int
    kind: str
    blobs: tuple[str, ...]
    nbytes: int


@dataclass(kw_only=True)
class FetchPlan:
    transfers: list[Transfer]
    points: dict[int, list[int]]
    """``points[r]``: iterations rank ``r`` will receive (every entry sourced)."""
    completed: dict[int, list[int]] = field(default_factory=dict)
    """``completed[r]``: points of ``r``'s own store that receive their remote entries (some may have
    no source: then ``skipped`` says which)."""
    skipped: dict[int, list[str]]
    """``skipped[r]``: why an iteration offered by ``r``'s holders cannot be rebuilt."""

    def sources_of(self, rank: int) -> list[int]:
        return sorted({t.src for t in self.transfers if t.dst == rank})


@dataclass(kw_only=True)
class FetchTopology:
    """The job layout the plan needs (identical on every rank)."""

    dp_group: Mapping[int, Sequence[int]]
    """Each rank's data-parallel group (dense operators)."""
    expert_dp_group: Mapping[int, Sequence[int]]
    """Each rank's expert-data-parallel group (expert operators)."""
    distributed_optimizer: bool


def needs_fetch(inv: Inventory, offered: set[int]) -> list[int]:
    """Iterations to fetch for a rank: those its holders offer beyond its newest local point (an empty
    local store — a replaced node — takes everything offered; a survivor's replicas are never newer than
    its own store)."""
    newest = max(inv.local, default=-1)
    return sorted(t for t in offered if t > newest)


def plan_fetch(inventories: Sequence[Inventory], topo: FetchTopology) -> FetchPlan:
    """Who sends what to whom (module docstring). Pure; every rank computes the same plan."""
    by_rank = {inv.rank: inv for inv in inventories}
    sent_bytes: dict[int, int] = defaultdict(int)
    blobs: dict[tuple[int, int, int, str], list[tuple[str, int]]] = defaultdict(list)
    points: dict[int, list[int]] = {}
    completed: dict[int, list[int]] = {}
    skipped: dict[int, list[str]] = {}
    for inv in sorted(inventories, key=lambda i: i.rank):
        r = inv.rank
        holders = [h for h in sorted(by_rank) if h != r and r in by_rank[h].replicas]  # whoever holds copies
        offered = {t for h in holders for t in by_rank[h].replicas.get(r, {})}
        for t in needs_fetch(inv, offered):
            choice, why = _source_point(inv, t, holders, by_rank, topo, sent_bytes)
            if choice is None:
                skipped.setdefault(r, []).append(f"iteration {t}: {why}")
                continue
            for key, (src, kind, blob, nbytes) in choice.items():
                sent_bytes[src] += nbytes
                blobs[(src, r, t, kind)].append((blob, nbytes))
            points.setdefault(r, []).append(t)
        for t, pinv in sorted(inv.local.items()):  # own points whose remote entries the peers hold
            sourced = False
            for key, (level, blob, nbytes) in sorted(pinv.missing.items()):
                src = _remote_source(inv, t, key, level, holders, by_rank, topo, sent_bytes)
                if src is None:
                    skipped.setdefault(r, []).append(f"iteration {t}: {key}@{level} (held by the replica peers) "
                                                     "is on none of them")
                    continue
                sent_bytes[src[0]] += nbytes
                blobs[(src[0], r, t, src[1])].append((blob, nbytes))
                sourced = True
            if sourced:
                completed.setdefault(r, []).append(t)
    transfers = [Transfer(src=src, dst=dst, iteration=t, kind=kind, blobs=tuple(b for b, _ in items),
                          nbytes=sum(n for _, n in items))
                 for (src, dst, t, kind), items in sorted(blobs.items())]
    return FetchPlan(transfers=transfers, points=points, skipped=skipped, completed=completed)


def _remote_source(inv: Inventory, t: int, key: str, level: str, holders: list[int], by_rank: Mapping[int, Inventory],
                   topo: FetchTopology, sent_bytes: Mapping[int, int]) -> tuple[int, str] | None:
    """``(src, kind)`` for remote entry ``key`` of rank ``inv.rank``'s own point ``t``: the least-loaded
    holder whose replica point has it, else an expert-data-parallel peer holding the same FULL entry
    (not with the distributed optimizer); ``None`` if nobody has it."""
    r = inv.rank
    candidates = [(h, REPLICA) for h in holders
                  if by_rank[h].replicas.get(r, {}).get(t, PointInventory()).entries.get(key, ("",))[0] == level]
    if not candidates and not topo.distributed_optimizer:
        group = (topo.expert_dp_group if OperatorId.parse(key).is_expert else topo.dp_group).get(r, ())
        candidates = [(q, PEER) for q in group if q != r and q in by_rank
                      and by_rank[q].local.get(t, PointInventory()).entries.get(key, ("",))[0] == level]
    if not candidates:
        return None
    return min(candidates, key=lambda c: (sent_bytes.get(c[0], 0), c[0]))


def _source_point(inv: Inventory, t: int, holders: list[int], by_rank: Mapping[int, Inventory],
                  topo: FetchTopology, sent_bytes: Mapping[int, int]):
    """``{op or "meta": (src, kind, blob, nbytes)}`` for every entry rank ``inv.rank`` had at ``t`` (its
    manifest, kept by the holders), or ``(None, reason)``."""
    r = inv.rank
    replica = lambda h: by_rank[h].replicas.get(r, {}).get(t)  # noqa: E731
    needed = next((replica(h).owner for h in holders if replica(h) is not None and replica(h).owner), None)
    if needed is None:
        return None, "no holder kept a valid copy of the owner's manifest"
    choice: dict[str, tuple[int, str, str, int]] = {}
    load = dict(sent_bytes)
    for key, (level, blob, nbytes) in sorted(needed.items()):
        candidates = [(h, REPLICA) for h in holders
                      if replica(h) is not None and replica(h).entries.get(key, ("",))[0] == level]
        if not candidates and key != META:
            group = (topo.expert_dp_group if OperatorId.parse(key).is_expert else topo.dp_group).get(r, ())
            if level == Level.COMPUTE.name or not topo.distributed_optimizer:
                candidates = [(q, PEER) for q in group if q != r and q in by_rank and
                              by_rank[q].local.get(t, PointInventory()).entries.get(key, ("",))[0] == level]
        if not candidates:
            return None, f"no holder or data-parallel peer has {key}@{level or 'META'}"
        src, kind = min(candidates, key=lambda c: (load.get(c[0], 0), c[0]))
        load[src] = load.get(src, 0) + nbytes
        choice[key] = (src, kind, blob, nbytes)
    src, kind, blob, nbytes = choice[META]
    choice[OWNER_MANIFEST] = (src, kind, OWNER_MANIFEST, 0)  # travels with the metadata, from a holder
    return choice, ""


# ------------------------------------------------------------------------------------------- execution
@dataclass(kw_only=True)
class FetchResult:
    """What this rank received (and from whom) and what it could not rebuild."""

    points: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    """Points of this rank's own store that received remote entries (optimizer recomputation)."""

    def to_json(self) -> dict:
        out = {"points": self.points, "sources": self.sources, "bytes": self.nbytes,
               "seconds": round(self.seconds, 4), "skipped": self.skipped}
        if self.completed:
            out["completed"] = self.completed
        return out


class PeerFetch:
    """Executes a :class:`FetchPlan` on one rank: serves its transfers and receives its own."""

    def __init__(self, transport: Transport, rank: int, local: SnapshotStore,
                 replica_store_of: Callable[[int], SnapshotStore]) -> None:
        self.transport, self.rank, self.local = transport, rank, local
        self.replica_store_of = replica_store_of

    def run(self, plan: FetchPlan) -> FetchResult:
        start = time.perf_counter()
        incoming = [t for t in plan.transfers if t.dst == self.rank]
        by_src: dict[int, list[Transfer]] = defaultdict(list)
        for t in incoming:
            by_src[t.src].append(t)
        received: dict[int, list[tuple[Transfer, PointMessage]]] = defaultdict(list)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def receive(src: int, expected: list[Transfer]) -> None:
            try:
                for transfer in expected:  # each pair is a FIFO; the sender follows the same order
                    message = self.transport.receive(src)
                    if message is None or message.iteration != transfer.iteration:
                        raise RuntimeError(f"peer fetch from rank {src}: expected iteration {transfer.iteration}, "
                                           f"got {None if message is None else message.iteration}")
                    with lock:
                        received[transfer.iteration].append((transfer, message))
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        threads = [threading.Thread(target=receive, args=(src, ts), name=f"moe-ft-fetch-from{src}", daemon=True)
                   for src, ts in sorted(by_src.items())]
        for thread in threads:
            thread.start()
        try:
            self._serve([t for t in plan.transfers if t.src == self.rank])
        finally:
            for thread in threads:
                thread.join()
        if errors:
            raise RuntimeError(f"peer fetch on rank {self.rank} failed: {errors[0]!r}") from errors[0]
        result = FetchResult(sources=sorted(by_src), skipped=list(plan.skipped.get(self.rank, [])))
        completing = set(plan.completed.get(self.rank, ()))
        for it in sorted(received):
            why = (self._complete if it in completing else self._publish)(it, received[it])
            if why:
                result.skipped.append(f"iteration {it}: {why}")
            else:
                (result.completed if it in completing else result.points).append(it)
                result.nbytes += sum(m.nbytes for _, m in received[it])
        result.seconds = time.perf_counter() - start
        return result

    def _serve(self, outgoing: list[Transfer]) -> None:
        """Send this rank's transfers. One that cannot be read (a point deleted meanwhile, a full or damaged
        file) ends the stream to every peer still waiting for this rank, so that their receives fail now: a
        process that stays alive after the error (in-process restarts) would otherwise leave them waiting for
        the dedicated group's timeout (a day)."""
        for i, transfer in enumerate(outgoing):
            try:
                message = self._message(transfer)
            except BaseException:
                for dst in sorted({t.dst for t in outgoing[i:]}):
                    with contextlib.suppress(Exception):  # the error below is the one to report
                        self.transport.close_to(dst)
                raise
            self.transport.send_point(transfer.dst, message)

    def _message(self, transfer: Transfer) -> PointMessage:
        store = self.local if transfer.kind == PEER else self.replica_store_of(transfer.dst)
        backend = store.backend
        with store.pin([transfer.iteration]):
            manifest = backend.read_blob(transfer.iteration, MANIFEST)
            blobs = {name: backend.read_blob(transfer.iteration, name) for name in transfer.blobs}
        owner = self.rank if transfer.kind == PEER else transfer.dst
        return PointMessage(owner=owner, iteration=transfer.iteration, manifest=manifest, blobs=blobs)

    def _complete(self, iteration: int, parts: list[tuple[Transfer, PointMessage]]) -> str:
        """Add the fetched remote entries to this rank's own point (each checked against the checksum in
        its manifest, ``SnapshotStore.add_blob``); the reasons of those that failed."""
        record = self.local.catalog([iteration]).point(iteration)
        if record is None:
            return "the point is no longer in the node-local store"
        by_blob = {e.blob: e for e in record.entries.values() if e.remote}
        why = []
        for transfer, message in parts:
            for name, data in message.blobs.items():
                entry = by_blob.get(name)
                if entry is None:
                    why.append(f"{name} from rank {transfer.src}: not a remote entry of the point")
                    continue
                try:
                    self.local.add_blob(iteration, entry, data)
                except (CorruptEntryError, ValueError, FileExistsError) as exc:
                    why.append(f"{entry.name} from rank {transfer.src}: {getattr(exc, 'reason', exc)}")
        return "; ".join(why)

    def _publish(self, iteration: int, parts: list[tuple[Transfer, PointMessage]]) -> str:
        """Verify every entry against the *owner's* checksums (its manifest, kept by the holder) and publish
        the point under that manifest, byte for byte; the reason on failure (nothing is published then)."""
        blobs = {name: data for _, m in parts for name, data in m.blobs.items()}
        owner_manifest = blobs.pop(OWNER_MANIFEST, None)
        if owner_manifest is None:
            return "the owner's manifest did not arrive"
        algo, good, meta, rejected = verify_message(PointMessage(owner=self.rank, iteration=iteration,
                                                                 manifest=owner_manifest, blobs=blobs))
        if rejected:
            sender = {name: t.src for t, m in parts for name in m.blobs}
            return "; ".join(f"{rej.entry} from rank {sender.get(rej.entry, '?')}: {rej.reason}" for rej in rejected)
        record = decode_manifest(owner_manifest, iteration, OWNER_MANIFEST)
        if len(good) + (meta is not None) != len(record.all_entries()):
            return f"{len(record.all_entries()) - len(good) - (meta is not None)} entries of the owner's manifest missing"
        backend = self.local.backend
        if iteration in backend.list_points():
            return "already in the node-local store"
        writer = backend.begin_point(iteration)
        try:
            for entry in record.all_entries():
                sink = writer.open_blob(entry.blob)
                sink.write(blobs[entry.blob])
                sink.close()
            writer.commit(owner_manifest)
        except BaseException:
            writer.abort()
            raise
        return ""


def fetch_from_peers(*, local: SnapshotStore, rank: int, world_size: int,
                     topo: FetchTopology, replica_store_of: Callable[[int], SnapshotStore],
                     replica_owners: Sequence[int] = (),
                     group_config: GlooTransportConfig | None = None) -> FetchResult:
    """Collective over all ranks (host path, ``moe_ft.comm``): exchange inventories, plan, and (only if some
    rank needs anything) move the entries on a dedicated gloo group. ``replica_owners``: the ranks whose
    replica stores this rank can serve (its node's); the holders of a rank's copies are whoever offers them.
    Returns this rank's :class:`FetchResult`."""

    holding = set(replica_owners) - {rank}
    mine = Inventory(rank=rank, local=inventory_of(local),
                     replicas={owner: inventory_of(replica_store_of(owner), replica=True) for owner in sorted(holding)})
    everyone = comm.all_gather_object(mine)
    if len(everyone) != world_size:
        raise RuntimeError(f"fetch_from_peers: world_size {world_size} but {len(everyone)} ranks answered")
    plan = plan_fetch(everyone, topo)
    if not plan.transfers:
        return FetchResult(skipped=list(plan.skipped.get(rank, [])))
    config = group_config or GlooTransportConfig()
    transport = GlooTransport(config, config.build_group())
    result = PeerFetch(transport, rank, local, replica_store_of).run(plan)
    if result.points:
        logger.warning("moe-ft recovery rank %d: node-local store rebuilt from peers %s: iterations %s (%.1f MB)",
                       rank, result.sources, result.points, result.nbytes / 1e6)
    if result.completed:
        logger.warning("moe-ft recovery rank %d: FULL entries the peers rebuilt fetched into iterations %s",
                       rank, result.completed)
    for line in result.skipped:
        logger.warning("moe-ft recovery rank %d: not fetched: %s", rank, line)
    return result


__all__ = ["FetchPlan", "FetchResult", "FetchTopology", "Inventory", "PeerFetch", "PointInventory", "Transfer",
           "fetch_from_peers", "inventory_of", "needs_fetch", "plan_fetch"]
