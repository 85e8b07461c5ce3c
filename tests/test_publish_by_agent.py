"""Publishing by the node agent (``--ft-publish-by agent``, ``moe_ft/store/handoff.py``, ``moe_ft/agent/publish.py``):
the trainer copies each tensor into its arena and hands the point over; a real agent process seals the entries,
writes the manifest and the index and collects garbage. The points are those the trainer would have published
itself (entry for entry, byte for byte), readers verify them, the allocator reuses the regions the agent's
garbage collection freed, and no kill (of the agent before or after it linked the index, of the trainer that
sent the order) leaves a torn point visible. The drill at the end trains with it and recovers bitwise."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from _ft_helpers import stop_process

from moe_ft.agent.client import agent_pid
from moe_ft.agent.publish import AgentPublisher
from moe_ft.agent.server import proc_stat
from moe_ft.cli.drill import run_job
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepNewestRecoverable, StoreConfig, StoreError
from moe_ft.store.backend import MANIFEST
from moe_ft.store.codec import CHECKSUMS, PENDING, new_checksum
from moe_ft.store.handoff import Finisher, MetaOrder, PublishOrder, finish_point, handed_over_anyway
from moe_ft.store.manifest import (
    META_BLOB,
    EntryRecord,
    TensorRecord,
    build_manifest,
    entry_json_bound,
    manifest_bound,
)

OPS = [OperatorId.expert_op(0, e) for e in range(3)]


def _store(root: Path, job: str):
    return StoreConfig(root=str(root), job_id=job, rank=0, layout="arena", checksum="mfh64").build(
        retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))


def _tensors(it: int) -> dict:
    g = torch.Generator().manual_seed(it)
    return {op: {"w": torch.randn(64, 33, generator=g), "i": torch.arange(7) * it} for op in OPS}


def _put(store, it: int) -> None:
    """Write point ``it`` (published by whoever the store's publisher is)."""
    with store.begin(it) as point:
        for op, tensors in _tensors(it).items():
            point.put(op, Level.FULL, tensors)
        point.put_meta({"iteration": it}, {"rng": torch.arange(3)})
        point.publish()


def _entry_bytes(store, it: int) -> dict:
    return {blob: store.backend.read_blob(it, blob) for blob in store.backend.blob_names(it) if blob != MANIFEST}


@pytest.fixture
def published(tmp_path):
    """``(store published by the agent, the same points published by the trainer, publisher)``."""
    mine, theirs = _store(tmp_path, "trainer"), _store(tmp_path, "agent")
    assert theirs.copies_hashing, "the CPU path hashes as it copies (moe-ft's C extension)"
    publisher = AgentPublisher(theirs, rank=0, agent_dir=tmp_path / "agent" / "agent")
    yield theirs, mine, publisher
    publisher.close()


def test_the_agent_publishes_what_the_trainer_would_and_its_collection_frees_regions(published):
    theirs, mine, publisher = published
    for it in range(12):
        _put(mine, it)
        _put(theirs, it)
        assert theirs.points() == mine.points() == [it]  # the agent collected the one before
        assert _entry_bytes(theirs, it) == _entry_bytes(mine, it)  # headers, padding, digests
        a, b = theirs.catalog().point(it), mine.catalog().point(it)
        assert a.entries == b.entries and a.meta == b.meta and a.writer["pid"] == os.getpid()
    for op, tensors in _tensors(11).items():
        got = theirs.load(11, op, Level.FULL)  # verified against the agent's digests
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert theirs.verify().iterations == [11]
    # the regions of the points the agent deleted were given out again: the arena did not grow point by point
    assert theirs.backend.arena_bytes == mine.backend.arena_bytes
    assert publisher.published == 12 and theirs.staging() == []


def test_a_killed_agent_is_started_again_and_gets_the_layouts_and_policy_again(published, tmp_path):
    theirs, _, publisher = published
    _put(theirs, 0)
    first = agent_pid(tmp_path / "agent" / "agent")
    os.kill(first, signal.SIGKILL)
    _put(theirs, 1)  # a new agent: it lacks the layouts and the retention policy, asks, and gets them
    assert publisher.client.restarts == 1 and theirs.points() == [1]
    assert theirs.verify().iterations == [1]


def test_an_agent_killed_while_it_publishes_leaves_nothing_torn_and_the_point_is_published_once(published, tmp_path):
    theirs, _, publisher = published
    _put(theirs, 0)
    first = agent_pid(tmp_path / "agent" / "agent")
    assert first is not None
    done = threading.Event()
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            _put(theirs, 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            errors.append(exc)
        done.set()

    try:
        stop_process(first)  # the order waits in its socket
        thread = threading.Thread(target=publish)
        started = time.monotonic()
        thread.start()
        time.sleep(0.5)
        # nothing of point 1 visible yet (the publishing thread's error, if any, and when it ended, say why not)
        assert not done.is_set(), (errors, time.monotonic() - started, proc_stat(first))
        assert theirs.points() == [0]
    finally:
        os.kill(first, signal.SIGKILL)  # never left stopped: the fixture's goodbye would wait for it
    thread.join(60)
    assert done.is_set() and errors == []
    assert theirs.points() == [1] and theirs.verify().iterations == [1] and publisher.client.restarts == 1


def test_an_order_answered_late_writes_nothing_into_the_regions_its_writer_freed(published, tmp_path):
    """A stopped agent does not answer within the bound: the trainer takes the order back and frees its regions,
    the next points are copied into them; the agent, continued, refuses the order it held without writing a byte
    (it used to seal the old entries over the new points and link the old index: no point was recoverable)."""
    theirs, _, publisher = published
    _put(theirs, 0)
    agent = agent_pid(tmp_path / "agent" / "agent")
    assert agent is not None
    publisher.client.timeout_s = 1.0
    try:
        stop_process(agent)  # the order waits in its socket
        with pytest.raises(RuntimeError, match="did not answer 'publish' within 1 s"):
            _put(theirs, 1)
        assert theirs.points() == [0] and theirs.staging() == []
    finally:
        os.kill(agent, signal.SIGCONT)
    publisher.client.timeout_s = 60.0
    for it in (2, 3):
        _put(theirs, it)
    log = tmp_path / "agent" / "agent" / "agent.log"
    deadline = time.monotonic() + 30
    while "withdrew the order" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "point 1 not published: its writer" in log.read_text()
    assert theirs.points() == [3] and theirs.verify().iterations == [3] and theirs.verify().problems == ()
    for op, tensors in _tensors(3).items():
        got = theirs.load(3, op, Level.FULL)
        assert all(torch.equal(got[n], t) for n, t in tensors.items())


@pytest.mark.parametrize("late", ["linked and kept", "linked and collected"])
def test_regions_of_an_order_an_agent_still_holds_stay_allocated_until_it_lets_go(tmp_path, late):
    """The trainer gave up on an order an agent had already claimed (it stopped while writing): the regions are
    neither freed nor the point's until the agent lets go; then they are the point's where it linked it."""
    from moe_ft.store import order_claim

    store = _store(tmp_path, "j")
    finisher = Finisher(_store(tmp_path, "j"))
    held: list[PublishOrder] = []

    class Publisher:
        rank = 0

        def publish(self, order, kinds, retention):
            order.kinds = {id(k): k for k, _ in kinds}
            order.layouts = {k.layout: layout for k, layout in kinds}
            order.retention, order.retention_id = retention, 1
            if order.iteration == 1:  # claimed, then no answer within the bound
                assert order_claim.claim(store.backend.staging_dir, order.marker)
                held.append(order)
                raise RuntimeError("the node agent did not answer 'publish' within 1 s")
            return finish_point(finisher, order)

    store.publisher = Publisher()  # type: ignore[assignment]
    _put(store, 0)
    with pytest.raises(RuntimeError, match="did not answer"):
        _put(store, 1)
    alloc = store.backend._alloc
    assert alloc is not None and list(alloc.in_doubt) != []
    doubtful = {(seg, off) for token in alloc.in_doubt for seg, off, _ in alloc.pending[token]}
    if late == "linked and kept":  # the agent goes on at once: point 1 is the newest, retention keeps it
        assert finish_point(finisher, held[0])["deleted"] == [0]
        with alloc.lock:
            alloc.settle()
        assert alloc.in_doubt == {} and {(seg, off) for seg, off, _ in alloc.points[1]} <= doubtful
        assert store.verify().problems == () and store.verify().iterations == [1]
        _put(store, 2)  # not into point 1's regions until it is collected
        assert store.points() == [2]
        return
    for it in (2, 3):
        _put(store, it)
        taken = {(seg, off) for seg, off, _ in store.backend._index(it).values()}
        assert not taken & doubtful, "a region of the order the agent holds was given to another point"
    assert list(alloc.in_doubt) != []
    # the agent goes on: it still holds the order, writes it and links the point (its garbage collection
    # deletes it at once: older than 3), then lets go; the regions are then free again
    assert finish_point(finisher, held[0])["deleted"] == [1]
    assert store.verify().problems == () and store.verify().iterations == [3]
    with alloc.lock:
        alloc.settle()
        free = alloc._free
    assert alloc.in_doubt == {} and 1 not in alloc.points
    assert all(any(s == seg and o <= off < o + n for s, o, n in free) for seg, off in doubtful)
    store.backend.close()


def test_an_order_whose_writer_is_gone_is_refused_and_a_linked_one_is_found(tmp_path):
    """The agent links no index for a writer after another process took the arena (it may have handed the
    regions out again); a trainer whose order failed after the link finds its point published."""
    store = _store(tmp_path, "j")
    with store.begin(0) as point:
        entry = point.reserve(OPS[0], Level.FULL, {"w": torch.ones(8)})
        entry.byte_views()[0].copy_(torch.ones(8).view(torch.uint8))
        meta = MetaOrder.of({"iteration": 0, "x": [1.5, "\u00e9"]}, {"rng": torch.arange(5)})
        blobs, rooms = point._writer.hand_over({MANIFEST: 4096, META_BLOB: meta.room()})
        order = PublishOrder(rank=0, store_dir=store.backend.describe(), iteration=0, checksum="mfh64",
                             writer_pid=os.getpid() + 10 ** 7, unsealed=[], sealed=[], meta=None, remote=[],
                             blobs={}, manifest_region=rooms[MANIFEST], meta_order=meta, meta_region=rooms[META_BLOB])
        finisher = Finisher(_store(tmp_path, "j"))
        with pytest.raises(StoreError, match="another process took the arena since its writer"):
            finish_point(finisher, order)
        assert store.points() == [] and handed_over_anyway(store.backend, 0, {}, rooms) is None
        order.writer_pid = os.getpid()
        written = finish_point(finisher, order)["written"]
        assert store.points() == [0] and set(written) == {MANIFEST, META_BLOB}
        assert handed_over_anyway(store.backend, 0, {}, rooms) == written
        assert handed_over_anyway(store.backend, 0, blobs, rooms) is None  # other regions: not this point
        assert finish_point(finisher, order)["written"] == written  # sent again: published once
        point._writer.abort()
    got = store.load_meta(0)  # the agent's metadata entry, verified
    assert got.meta == {"iteration": 0, "x": [1.5, "\u00e9"]} and torch.equal(got.tensors["rng"], torch.arange(5))


def test_metadata_that_is_not_json_fails_the_publish_and_leaves_nothing(published):
    theirs, _, _ = published
    _put(theirs, 0)
    with theirs.begin(1) as point:
        point.put_meta({"bad": {1, 2}})  # a set: the agent's JSON encoder refuses it
        with pytest.raises(RuntimeError, match="metadata of iteration 1 is not JSON-serialisable"):
            point.publish()
    assert theirs.points() == [0] and theirs.staging() == []


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_training_with_the_agent_publishing_recovers_bitwise_from_a_kill_between_copy_and_publish(
        corpus, tmp_path, fault_free_digest):
    """EP=2 x PP=2, sparse: rank 1 is killed at iteration 5 after its copy, before it handed the point over
    (the window [3, 5] never completes on it: back to [0, 2]). The job ends bitwise equal to the fault-free
    run, and the FT line counts the points the agent published."""
    faults = ["1:5:publish"]
    res = run_job(job="publish_by_agent", workdir=str(tmp_path), faults=faults, max_restarts=1, timeout=300,
                  layout="ep2pp2", policy="sparse", iters=10, data=corpus, store=str(tmp_path / "store"), window=3,
                  extra=["--ft-publish-by", "agent", "--ft-log-interval", "1"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("ep2pp2", 10)
    (report,) = res["reports"]
    assert report["recovery_point"]["end"] == 2 and report["recovery_point"]["source"] == "memory"
    log = Path(res["log"]).read_text()
    assert re.search(r"agent published [1-9]\d* points", log), log[-3000:]


def test_the_flag_needs_the_arena_and_has_moe_ft_launch_start_the_agent():
    from moe_ft.launch.cli import node_agent_of
    from moe_ft.snapshot.config import SnapshotConfig

    with pytest.raises(ValueError, match="--ft-publish-by agent .* needs --ft-store-layout arena"):
        SnapshotConfig(publish_by="agent", store_layout="files")
    assert node_agent_of(["--ft", "--ft-store-dir", "/s", "--ft-job-id", "j", "--ft-publish-by", "agent"])[0] == "/s/j/agent"
    assert node_agent_of(["--ft", "--ft-store-dir", "/s", "--ft-job-id", "j"]) is None


def test_the_metadata_entry_fits_the_room_reserved_before_it_is_encoded():
    """The trainer reserves the metadata entry's region from the pickle's size alone: the entry the agent
    encodes fits it for the metadata that grows most from pickle to JSON (one object referenced many times,
    booleans, control and non-BMP characters, floats of every length, large integers)."""
    shared = "s" * 1000
    metas = [{"rng.python": [3, list(range(624)), None], "lr": 1e-3},
             {"many": [shared] * 300, "same": [[1.5, 2.5]] * 200},
             {"flags": [False] * 5000, "nothing": [None] * 5000},
             {"text": "\x00\x01\x1f" * 3000 + "\U0001F600" * 2000 + "é" * 2000},
             {"floats": [1 / 3, -1e-310, 1.7976931348623157e308, 2.0 ** -1074] * 500, "big": [2 ** 200] * 200}]
    for meta in metas:
        order = MetaOrder.of(meta, {"rng": torch.arange(5), "empty": torch.zeros(0, 3)})
        data, written = order.entry(7, "mfh64")
        assert len(data) == written.nbytes <= order.room(), (len(data), order.room())


_KILLED_AFTER_SENDING = r"""
import os, signal, sys
import torch
from moe_ft.agent.client import AgentClient
from moe_ft.agent.publish import AgentPublisher
from moe_ft.agent.server import proc_stat
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepNewestRecoverable, StoreConfig
ops = [OperatorId.expert_op(0, e) for e in range(3)]
store = StoreConfig(root=sys.argv[1], job_id="j", rank=0, layout="arena", checksum="mfh64").build(
    retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(ops))))
AgentPublisher(store, rank=0, agent_dir=os.path.join(sys.argv[1], "agent"))
answer = AgentClient._answer
def killed_once_sent(self, conn, kind):
    if kind == "publish" and store_point[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the order is in the agent's socket, the answer never read
    return answer(self, conn, kind)
AgentClient._answer = killed_once_sent
store_point = [0]
for it in (1, 2):
    store_point[0] = it
    with store.begin(it) as point:
        for op in ops:
            point.put(op, Level.FULL, {"w": torch.full((300,), float(it))})
        point.put_meta({"iteration": it})
        point.publish()
"""


def test_a_trainer_killed_after_it_sent_its_order_has_its_point_published_and_kept(tmp_path):
    """The trainer is SIGKILLed with its order for point 2 sent and unanswered: the agent publishes it (holding the
    arena's lock, which the dead trainer released), complete and verified; the next writer's allocator takes its
    regions as the point's and writes point 3 elsewhere."""
    import subprocess
    import sys

    from tests._ft_helpers import ROOT, wait_until

    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _KILLED_AFTER_SENDING, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    store = _store(tmp_path, "j")
    wait_until(lambda: store.points() == [2], timeout=30, message=str(store.points()))
    assert store.verify().problems == ()
    with store.begin(3) as point:  # a new allocator (this process): point 2's regions are not free to it
        for op in OPS:
            point.put(op, Level.FULL, {"w": torch.full((300,), 3.0)})
        point.put_meta({"iteration": 3})
        point.publish()
    assert store.points() == [3] and store.verify().problems == ()  # retention dropped 2 only after 3 was complete
    assert torch.equal(store.load(3, OPS[0], Level.FULL)["w"], torch.full((300,), 3.0))


def _optimizer_names(layer: int, num_params: int) -> dict:
    """A dense layer's tensors as the distributed optimizer names them (``moe_ft/state/shards.py``: each
    parameter's master weights and moments tagged with the range this rank holds): long names, many of them."""
    out = {}
    for p in range(num_params):
        name = f"decoder.layers.{layer}.self_attention.linear_qkv.parameter_{p}.weight"
        out[name] = torch.full((16,), float(p))
        for key in ("master", "exp_avg", "exp_avg_sq"):
            out[f"{key}@0:8:16.{name}"] = torch.zeros(8)
    return out


def test_the_manifest_room_is_sized_from_the_tensor_tables_of_the_first_point_and_of_every_other(published):
    """The trainer reserves the manifest's region before the agent encodes it: sized from the entries' tensor
    records, the first point's manifest fits (two operators of 40 optimizer-named tensors: ~10 KB, where 2 KiB an
    entry gave 8 KiB and every publish failed), and so does a later point of as many entries whose tables are
    longer (a policy that saves other operators at each point)."""
    theirs, _, _ = published
    ops = [OperatorId.dense(0), OperatorId.dense(1)]
    theirs.retention = KeepNewestRecoverable(rule=DenseRule(operators=frozenset(ops)))
    sizes = []
    for it, num_params in ((0, 10), (1, 10), (2, 40)):
        with theirs.begin(it) as point:
            for layer, op in enumerate(ops):
                point.put(op, Level.FULL, _optimizer_names(layer, num_params))
            point.put_meta({"iteration": it}, {"rng": torch.arange(3)})
            point.publish()
        assert theirs.points() == [it] and theirs.verify().iterations == [it]
        sizes.append(theirs.backend.blob_size(it, MANIFEST))
    assert 8192 < min(sizes[:2]) and sizes[2] > 2 * max(sizes[:2])  # twice the last would not have held it
    got = theirs.load(2, ops[1], Level.FULL)
    assert torch.equal(got["decoder.layers.1.self_attention.linear_qkv.parameter_39.weight"], torch.full((16,), 39.0))


def test_the_manifest_bound_holds_for_every_kind_of_entry():
    """``manifest_bound`` of the entries' JSON bounds is at least the manifest written, remote entries and a
    metadata entry included, for every checksum (a deferred digest is empty, sha256's is 64 characters)."""
    tables = [tuple(TensorRecord(f"master@0:{n}:{2 * n}.decoder.layers.{n}.w{i}", "float32", (n, 3), 12 * n)
                    for i in range(n)) for n in (1, 7, 40)]
    for algo in CHECKSUMS:
        digest = new_checksum(algo).digest().hex()
        entries = [EntryRecord(10 ** 11, OperatorId.dense(i), Level.FULL, f"dense.{i}.full.ent", 10 ** 9, digest, t)
                   for i, t in enumerate(tables)]
        remote = [EntryRecord(10 ** 11, OperatorId.expert_op(0, 1), Level.FULL, "e.ent", 99, PENDING, tables[1])]
        meta = EntryRecord(10 ** 11, None, None, META_BLOB, 123456, PENDING, tables[0])
        data, _ = build_manifest(10 ** 11, algo, entries, meta, remote)
        bound = manifest_bound(10 ** 11, algo, [entry_json_bound(e, algo) for e in entries],
                               entry_json_bound(meta, algo), [entry_json_bound(e, algo) for e in remote])
        assert len(data) <= bound <= len(data) + 1024, (algo, len(data), bound)
