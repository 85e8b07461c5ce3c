"""Entries filled in place in the arena's mapped regions (the GPU snapshot path's store side, run here on
CPU tensors): byte for byte the entry ``put`` writes, whether the payload is hashed on the host or its
``mfh64`` share comes from the kernel (``TRITON_INTERPRET=1``, set by conftest), and every damaged byte
is caught when the point is read."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import KeepAll, StoreConfig
from moe_ft.store import entry_hash as eh
from moe_ft.store import entry_hash_triton as et
from moe_ft.store.codec import tensor_specs
from moe_ft.store.errors import CorruptEntryError

OP = OperatorId.expert_op(0, 1)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),  # 1406 B: a half word at the end
            "master.weight": torch.randn(37, 19, generator=g),
            "flags": torch.randint(0, 2, (3,), generator=g).bool(),  # 3 B: a partial word
            "odd": torch.randint(-9, 9, (7,), generator=g, dtype=torch.int8),
            "step": torch.tensor(5.0),
            "empty": torch.empty(0, 4)}


def store(tmp_path, name, checksum="mfh64", layout="arena"):
    return StoreConfig(root=str(tmp_path), job_id=name, rank=0, checksum=checksum, layout=layout).build(
        retention=KeepAll())


def flip_bit(path: str, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def blob_bytes(st, it, blob):
    with st.backend.open_blob(it, blob) as f:
        return f.read()


def device_sums(reserved, src: dict[str, torch.Tensor]) -> list[list[int]]:
    """What the GPU path computes: the table for the tensors it takes, one by one for the rest."""
    srcs = list(src.values())
    rows = [i for i, t in enumerate(srcs) if et.tableable(t) and t.numel()]
    out: list = [None] * len(srcs)
    if rows:
        got = et.TensorTable([srcs[i] for i in rows], [reserved.first_words[i] for i in rows], block=64).launch()
        for k, i in enumerate(rows):
            out[i] = got[k].tolist()
    for i, t in enumerate(srcs):
        if out[i] is None:
            out[i] = et.device_lane_sums(t, reserved.first_words[i]).tolist()
    return out


def sealed_point(st, it, src, how):
    with st.begin(it) as p:
        reserved = p.reserve(OP, Level.FULL, src)
        for name, t in src.items():
            reserved.views[name].copy_(t)
        reserved.seal(None if how == "host" else device_sums(reserved, src))
        p.put_meta({"i": it})
        p.publish()
        assert p.touched == (0 if how == "device" else reserved.layout.body)
    return reserved


def test_an_entry_sealed_in_place_reads_back_as_put_writes_it(tmp_path):
    """Hashed on the host or on the device: byte for byte the entry ``put`` writes."""
    src = tensors()
    ref = store(tmp_path, "ref")
    ref.copies_hashing = False  # write_entry's stream
    with ref.begin(3) as p:
        p.put(OP, Level.FULL, src)
        p.put_meta({"i": 3})
        p.publish()
    host, dev = store(tmp_path, "host"), store(tmp_path, "dev")
    r = sealed_point(host, 3, src, "host")
    sealed_point(dev, 3, src, "device")
    assert blob_bytes(host, 3, r.blob) == blob_bytes(dev, 3, r.blob) == blob_bytes(ref, 3, r.blob)
    for st in (ref, host, dev):
        assert st.verify([3]).problems == ()
        loaded = st.load(3, OP, Level.FULL)
        assert all(torch.equal(loaded[n], t) and loaded[n].dtype == t.dtype for n, t in src.items())
    assert host.load_meta(3).meta == ref.load_meta(3).meta


@pytest.mark.skipif(not eh.NATIVE, reason="moe-ft's C extension is not built (no C compiler)")
def test_a_put_that_hashes_as_it_copies_writes_the_streamed_entry_in_one_pass(tmp_path):
    """On the arena with ``mfh64`` and its C build, ``put`` copies each tensor into its region and hashes it in
    the same pass: byte for byte the entry ``write_entry`` streams, one host pass over the payload (the
    stream hashes and writes: two), and a byte that changes in the region after the copy is caught."""
    src = tensors(4)
    ref, one = store(tmp_path, "ref"), store(tmp_path, "one")
    assert one.copies_hashing and not store(tmp_path, "xxh", checksum="xxh3_64").copies_hashing
    assert not store(tmp_path, "files", layout="files").copies_hashing
    ref.copies_hashing = False
    payload = sum(t.nbytes for t in src.values())
    recs = []
    for st, passes in ((ref, 2), (one, 1)):
        with st.begin(5) as p:
            recs.append(p.put(OP, Level.FULL, src))
            touched = p.touched
            p.put_meta({"i": 5})
            p.publish()
        assert payload * passes <= touched < payload * passes + 4096, (st, touched)
    rec = recs[1]
    assert blob_bytes(one, 5, rec.blob) == blob_bytes(ref, 5, rec.blob)
    assert rec == recs[0] and one.verify([5]).problems == ()
    loaded = one.load(5, OP, Level.FULL)
    assert all(torch.equal(loaded[n], t) and loaded[n].dtype == t.dtype for n, t in src.items())

    copy = eh.copy_lane_sums

    def flipped_after_the_copy(t, dst, first):  # the region changes after the bytes passed through the copy
        sums = copy(t, dst, first)
        if dst.numel() > 100:
            dst[100] ^= 4
        return sums

    late = store(tmp_path, "late")
    with late.begin(6) as p:
        eh_copy, eh.copy_lane_sums = eh.copy_lane_sums, flipped_after_the_copy
        try:
            p.put(OP, Level.FULL, src)
        finally:
            eh.copy_lane_sums = eh_copy
        p.put_meta({})
        p.publish()
    with pytest.raises(CorruptEntryError):
        late.load(6, OP, Level.FULL)


def test_a_layout_is_reused_until_the_iteration_gains_a_digit(tmp_path):
    st = store(tmp_path, "s")
    src = tensors(1)
    reserves = []
    for it in (1, 10, 10 ** 12):  # laid out for 12 digits: 10^12 has 13
        with st.begin(it) as p:
            r = p.reserve(OP, Level.COMPUTE, src)
            for name, t in src.items():
                r.views[name].copy_(t)
            r.seal(device_sums(r, src))
            p.put_meta({})
            p.publish()
        assert st.verify([it]).problems == ()
        reserves.append(r.layout)
    assert reserves[0] == reserves[1] and reserves[2] is not reserves[0]
    assert len(st._layouts) == 2


def test_every_damaged_byte_of_a_mapped_entry_is_caught(tmp_path):
    src = tensors(2)
    st = store(tmp_path, "s")
    with st.begin(0) as p:
        r = p.reserve(OP, Level.FULL, src)
        for name, t in src.items():
            r.views[name].copy_(t)
        r.seal(device_sums(r, src))
        p.put_meta({})
        p.publish()
    path, off, n = st.backend.blob_location(0, r.blob)
    # head, padding, each tensor, the digest, the trailer: one flipped bit anywhere
    for pos in sorted({0, 20, r.layout.table[0]["offset"] - 1, *(t["offset"] for t in r.layout.table if t["nbytes"]),
                       r.layout.body - 1, r.layout.body + 3, n - 1}):
        flip_bit(path, off + pos, pos % 8)
        with pytest.raises(CorruptEntryError):
            st.load(0, OP, Level.FULL)
        flip_bit(path, off + pos, pos % 8)  # restore
        st.load(0, OP, Level.FULL)


def test_a_remote_entry_hashed_on_the_device_records_the_host_digest(tmp_path):
    src = tensors(3)
    ref, st = store(tmp_path, "ref"), store(tmp_path, "dev")
    with ref.begin(2) as p:
        want = p.put_remote(OP, src)
    with st.begin(2) as p:
        layout = p.layout(OP, Level.FULL, tensor_specs(src))
        sums = [eh.lane_sums_of(t, f) for t, f in zip(src.values(), layout.first_words)]
        got = p.put_remote(OP, src, tensor_sums=sums, layout=layout)
        assert p.touched == 0
    assert got.checksum == want.checksum and got.nbytes == want.nbytes


def test_only_the_arena_maps_regions_and_device_digests_need_mfh64(tmp_path):
    files = store(tmp_path, "files", layout="files")
    with files.begin(0) as p, pytest.raises(ValueError, match="cannot map regions"):
        p.reserve(OP, Level.FULL, tensors())
    xxh = store(tmp_path, "xxh", checksum="xxh3_64")
    with xxh.begin(0) as p:
        r = p.reserve(OP, Level.FULL, tensors())
        with pytest.raises(ValueError, match="mfh64"):
            r.seal([[0, 0]] * len(r.views))


def test_a_snapshot_reserves_its_regions_at_once_and_a_refused_batch_leaves_nothing(tmp_path):
    """``reserve_all``: the entries' regions in one call (views made when asked for), each at the address its
    view has; an operator twice in one batch, a level NONE, neither tensors nor specs, or a point already
    published is refused, and the refused point leaves nothing behind."""
    st = store(tmp_path, "batch")
    other = OperatorId.expert_op(0, 2)
    with st.begin(0) as p:
        assert p.reserve_all([]) == []
        a, b = p.reserve_all([(OP, Level.FULL, tensors(), None), (other, Level.COMPUTE, tensors(), None)])
        assert a.address == a.byte_views()[0].data_ptr() - a.layout.table[0]["offset"] and a.address != b.address
        for r in (a, b):
            for view, t in zip(r.views.values(), tensors().values()):
                view.copy_(t)
            r.seal()
        p.publish()
    with pytest.raises(ValueError, match="already published"):
        st.begin(0)
    with st.begin(1) as p:
        with pytest.raises(ValueError, match="already holds"):
            p.reserve_all([(OP, Level.FULL, tensors(), None), (OP, Level.COMPUTE, tensors(), None)])
        with pytest.raises(ValueError, match="level NONE"):
            p.reserve_all([(other, Level.NONE, tensors(), None)])
        with pytest.raises(ValueError, match="specs"):
            p.reserve_all([(other, Level.FULL, None, None)])
    assert st.points() == [0] and st.staging() == [] and st.verify().problems == ()
    assert torch.equal(st.load(0, OP, Level.FULL)["master.weight"], tensors()["master.weight"])


def test_streaming_mfh64_equals_the_reference_for_any_split():
    data = bytes(torch.randint(0, 256, (1001,), dtype=torch.uint8).numpy())
    want = eh.reference_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for step in (1, 3, 4, 5, 64, 1001):
        h = eh.Mfh64()
        for i in range(0, len(data), step):
            h.update(data[i:i + step])
        assert h.digest() == want, step


@pytest.mark.parametrize("kernel,paced,copy_by,agent", [
    (True, False, "dma", False), (False, False, "dma", False), (True, True, "dma", False), (True, False, "kernel", False),
    (True, True, "kernel:2", False), (True, False, "kernel", True), (False, False, "dma", True)],
    ids=["kernel-hashes", "host-hashes", "kernel-hashes-paced", "kernel-copies", "kernel-copies-2-programs-rest-paced",
         "kernel-copies-agent-publishes", "host-hashes-agent-publishes"])
def test_the_mapped_copier_writes_the_entries_put_writes(tmp_path, kernel, paced, copy_by, agent):
    """The GPU snapshot path's copier (moe_ft/snapshot/mapped.py) on CPU tensors: regions reserved, bytes
    copied in place, sums from the kernel (every tensor taken as a device tensor) or the host, entries
    sealed; a second snapshot of another composition and one of the first again (its cached plan). Paced:
    the copy is cut into 1000-byte pieces (moe_ft/snapshot/pacing.py), a pause between each two (on a GPU a
    device-side sleep; here recorded), with the same bytes sealed. Kernel copies: the hash kernel stores the
    words it hashes into the regions (on two programs: each takes every second block), the tensors it cannot
    take (partial words) go by the copy the pacer cuts; when an arena segment could not be page-locked, or its
    device address not be had, the copier goes back to the copy engine (the third snapshot). Agent publishes:
    the copier hands each entry's sums over and a node agent process seals and publishes the points
    (``--ft-publish-by agent``), with the same bytes."""
    from types import SimpleNamespace

    from moe_ft.snapshot.mapped import MappedCopier
    from moe_ft.snapshot.pacing import CopyPacer

    ops = [OperatorId.expert_op(0, e) for e in range(3)]
    state = {op: tensors(i) for i, op in enumerate(ops)}
    entries = {(op, lvl): SimpleNamespace(op=op, level=lvl, out=dict(state[op]), srcs=list(state[op].values()))
               for op in ops for lvl in (Level.FULL, Level.COMPUTE)}
    st = store(tmp_path, "mapped")
    publisher = None
    if agent:
        from moe_ft.agent.publish import AgentPublisher

        publisher = AgentPublisher(st, rank=0, agent_dir=tmp_path / "agent")
    pauses: list[float] = []
    pacer = CopyPacer(1000, gap_us=7.0, pause=pauses.append) if paced else None
    how, _, programs = copy_by.partition(":")
    copier = MappedCopier(st, None, on_device=(lambda t: True) if kernel else None, pacer=pacer, copy_by=how,
                          programs=int(programs or 0))
    by_kernel = how == "kernel"
    plans = [({ops[0]: Level.FULL, ops[1]: Level.COMPUTE}, frozenset()),
             ({ops[1]: Level.FULL, ops[2]: Level.FULL}, frozenset({ops[2]})),
             ({ops[0]: Level.FULL, ops[1]: Level.COMPUTE}, frozenset())]
    for it, (plan, remote) in enumerate(plans):
        items = [entries[(op, lvl)] for op, lvl in plan.items()]
        if remote:
            items.append(entries[(ops[2], Level.COMPUTE)])
        if by_kernel and it == 2:  # a segment the device cannot reach: the copy engine takes over
            if paced:
                copier.pinned.unreachable = "cuMemHostGetDevicePointer failed (simulated)"
            else:
                copier.pinned.failed = "cudaHostRegister of 4096 B failed (simulated)"
        job = copier.issue(it, it % 2, items, remote)
        assert copier.copy_by == ("dma" if copier.pinned.failed or copier.pinned.unreachable else how)
        if paced:  # each piece but the first waits for the pause after the one before it
            copied = sum(t.nbytes for item in items if not (item.op in remote and item.level == Level.FULL)
                         for t in item.srcs if not (copier.copy_by == "kernel" and et.tableable(t)))
            assert pacer.pieces == -(-copied // 1000) > 1 and pauses == [7.0] * (pacer.pieces - 1)
            pauses.clear()
        with job.point as point:
            copier.seal(job)
            point.put_meta({"i": it})
            point.publish()
        assert (job.host_bytes == 0) == kernel and point.touched == 0
        ref = store(tmp_path, f"ref{it}")
        with ref.begin(it) as p:
            for item in items:
                if item.op in remote and item.level == Level.FULL:
                    want = p.put_remote(item.op, item.out)
                else:
                    p.put(item.op, item.level, item.out)
            p.put_meta({"i": it})
            p.publish()
        assert st.verify([it]).problems == ()
        names = [b for b in ref.backend.blob_names(it) if b.endswith(".ent") and "meta" not in b]
        assert len(names) == len(items) - len(remote)
        for b in names:
            assert blob_bytes(st, it, b) == blob_bytes(ref, it, b), (it, b)
        if remote:
            got = st.catalog([it]).point(it).entries[ops[2]]
            assert got.remote and got.checksum == want.checksum
    assert len(copier._plans) == 2  # the third snapshot reused the first one's plan
    copier.close()
    if publisher is not None:
        assert publisher.published == len(plans)
        publisher.close()


def test_host_resident_tensors_are_sealed_as_copied_at_issue_not_as_they_are_at_seal(tmp_path):
    """A CUDA registry's host-resident tensors (torch Adam's CPU ``step`` counter) are copied into their regions
    when the snapshot is issued and sealed later on the background thread; the training thread's next optimizer
    step changes them in between. The digest is of the bytes copied (a remote entry's: of the tensor at issue),
    so the point verifies and restores the state the snapshot took; hashed from the live tensor, it failed."""
    from types import SimpleNamespace

    from moe_ft.snapshot.mapped import MappedCopier

    ops = [OperatorId.expert_op(0, e) for e in range(2)]
    state = {op: {"weight": torch.randn(256), "step": torch.tensor(5.0)} for op in ops}
    taken = {op: {k: v.clone() for k, v in t.items()} for op, t in state.items()}
    items = [SimpleNamespace(op=op, level=lvl, out=state[op], srcs=list(state[op].values()))
             for op, lvl in ((ops[0], Level.FULL), (ops[1], Level.FULL), (ops[1], Level.COMPUTE))]
    st = store(tmp_path, "mapped")
    copier = MappedCopier(st, None, on_device=lambda t: False)  # every source host-resident
    job = copier.issue(7, 0, items, frozenset({ops[1]}))  # the training thread, at submit
    for tensors in state.values():  # the training thread's next optimizer step, before the seal ran
        tensors["step"].add_(1)
        tensors["weight"].mul_(2)
    with job.point as point:  # the background thread
        copier.seal(job)
        point.put_meta({"iteration": 7})
        point.publish()
    copier.close()
    assert st.verify([7]).problems == ()
    for op, level in ((ops[0], Level.FULL), (ops[1], Level.COMPUTE)):
        got = st.load(7, op, level)
        assert all(torch.equal(got[k], v) for k, v in taken[op].items()), (op, level)
    ref = store(tmp_path, "ref")
    with ref.begin(7) as p:
        want = p.put_remote(ops[1], taken[ops[1]])
    assert st.catalog([7]).point(7).entries[ops[1]].checksum == want.checksum


_KILLED_WRITER = r"""
import os, signal, sys
from types import SimpleNamespace
import torch
from moe_ft.snapshot.mapped import MappedCopier
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import KeepAll, StoreConfig
st = StoreConfig(root=sys.argv[1], job_id="j", rank=0, checksum="mfh64").build(retention=KeepAll())
op = OperatorId.expert_op(0, 0)
w = {"w": torch.arange(1 << 16, dtype=torch.float32)}
entry = SimpleNamespace(op=op, level=Level.FULL, out=w, srcs=list(w.values()))
copier = MappedCopier(st, None)
for it in (1, 2):
    job = copier.issue(it, 0, [entry], frozenset())
    if it == 2 and sys.argv[2] == "copied":
        os.kill(os.getpid(), signal.SIGKILL)  # the bytes are in the region, nothing is sealed
    copier.seal(job)
    if it == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # sealed, the index not linked
    job.point.put_meta({})
    job.point.publish()
"""


@pytest.mark.parametrize("phase", ["copied", "sealed"])
def test_a_writer_killed_between_the_copy_and_the_publish_leaves_no_point(tmp_path, phase):
    """SIGKILL after the copy into the regions (and after sealing them): the point never becomes visible,
    the published one stays verified, and the next writer reuses the regions."""
    import subprocess
    import sys

    from tests._ft_helpers import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), phase], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    st = StoreConfig(root=str(tmp_path), job_id="j", rank=0, checksum="mfh64").build(retention=KeepAll())
    assert st.points() == [1] and st.verify().problems == ()
    size = st.backend.arena_bytes
    with st.begin(2) as p:
        r = p.reserve(OperatorId.expert_op(0, 0), Level.FULL, {"w": torch.zeros(1 << 16)})
        r.seal(None)
        p.put_meta({})
        p.publish()
    assert st.verify().problems == () and st.backend.arena_bytes == size  # the killed writer's regions reused


def test_the_digest_from_device_sums_equals_the_host_digest_whatever_the_header_length():
    """The padding's share is hashed once per layout (``EntryLayout.padding``) and the header's on every seal:
    for headers of every length mod 4 and keys of several widths on one layout, the digest sealed from the
    tensors' sums equals the host's hash of the whole region."""
    from moe_ft.store.codec import entry_head, layout_entry, seal_entry

    src = tensors(2)
    lengths = set()
    for extra in range(1, 5):  # a key one character longer moves the header's end by one byte
        named = {("x" * extra) + name: t for name, t in src.items()}
        layout = layout_entry({"iteration": 0, "op": "o" * extra}, tensor_specs(named), eh.ALGO)
        for it in (7, 123456, 10 ** 11):
            head = entry_head(layout, {"iteration": it, "op": "o" * extra}, eh.ALGO)
            lengths.add(len(head) % 4)
            host, dev = bytearray(layout.size), bytearray(layout.size)
            for region in (host, dev):
                for rec, t in zip(layout.table, named.values()):
                    region[rec["offset"]:rec["offset"] + rec["nbytes"]] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            sums = [eh.lane_sums_of(t, first) for t, first in zip(named.values(), layout.first_words)]
            a = seal_entry(memoryview(host), layout, head, eh.ALGO)
            b = seal_entry(memoryview(dev), layout, head, eh.ALGO, sums)
            assert a.checksum == b.checksum and host == dev and b.hashed == layout.table[0]["offset"] + sum(
                layout.table[i + 1]["offset"] - -(-(r["offset"] + r["nbytes"]) // 4) * 4
                for i, r in enumerate(layout.table[:-1]))
    assert lengths == {0, 1, 2, 3}


def test_a_header_from_its_template_is_the_header_and_its_sums_are_its_hash():
    """``sealed_head``: the header is built and hashed once per layout, key and number of digits, then only the
    words of the iteration's digits are hashed again: for iterations of every width (their digits end at every
    offset mod 4) and several keys, the header equals ``entry_head``'s and its sums a fresh hash; another checksum
    or a key whose JSON does not start with the iteration takes the plain path."""
    import random

    from moe_ft.store.codec import entry_head, key_rest, layout_entry, sealed_head, templated_head

    rng = random.Random(0)
    specs = tensor_specs(tensors(3))
    for op in ("e", "expert.L0.E1", "expert.L12.E100"):
        layout = layout_entry({"iteration": 0, "level": "FULL", "operator": op}, specs, eh.ALGO)
        for it in [0, 7, 9, 10, 99, 100, 12345, 10 ** 11, 10 ** 12 - 1] + [rng.randrange(10 ** 12) for _ in range(40)]:
            key = {"iteration": it, "level": "FULL", "operator": op}
            head, sums = sealed_head(layout, key, eh.ALGO)
            assert head == entry_head(layout, key, eh.ALGO) and sums == eh.bytes_lane_sums(head), (op, it)
        assert len(layout.heads) <= 12
    first = {"epoch": 1, "iteration": 5}  # "epoch" sorts before "iteration": no template
    layout = layout_entry(first, specs, eh.ALGO)
    head, sums = sealed_head(layout, first, eh.ALGO)
    assert head == entry_head(layout, first, eh.ALGO) and sums == eh.bytes_lane_sums(head) and not layout.heads
    xx = layout_entry({"iteration": 3}, specs, "xxh3_64")
    assert sealed_head(xx, {"iteration": 3}, "xxh3_64") == (entry_head(xx, {"iteration": 3}, "xxh3_64"), None)
    # values equal in Python but not in JSON (1, 1.0, True), and the same items in another order, on one layout
    layout = layout_entry({"iteration": 0, "x": 1.0}, specs, eh.ALGO)
    for it in (5, 6, 123):
        for key in ({"iteration": it, "x": 1}, {"iteration": it, "x": True}, {"iteration": it, "x": 1.0},
                    {"x": 1, "iteration": it}):
            head, sums = sealed_head(layout, key, eh.ALGO)
            assert head == entry_head(layout, key, eh.ALGO) and sums == eh.bytes_lane_sums(head), (key, it)
            # the template found by the key's rest (what a reserved entry passes, building no key)
            assert templated_head(layout, it, key_rest(key), eh.ALGO) == (head, sums), (key, it)
    fresh = layout_entry({"iteration": 0, "x": 2}, specs, eh.ALGO)
    assert templated_head(fresh, 5, key_rest({"iteration": 5, "x": 2}), eh.ALGO) is None  # no template yet
    assert templated_head(layout, 5, key_rest({"iteration": 5, "x": 1}), "xxh3_64") is None  # another checksum


def test_an_entry_without_tensors_sealed_from_sums_equals_its_host_hash():
    """No tensor: the header is the whole body (its length any number mod 4); the digest from the header's and the
    padding's shares equals the host's hash of the region, and every byte of it counts as hashed on the host."""
    from moe_ft.store.codec import entry_head, layout_entry, seal_entry

    for extra in range(1, 5):
        key = {"iteration": 3, "op": "o" * extra}
        layout = layout_entry(key, (), eh.ALGO)
        head = entry_head(layout, key, eh.ALGO)
        host, dev = bytearray(layout.size), bytearray(layout.size)
        a = seal_entry(memoryview(host), layout, head, eh.ALGO)
        b = seal_entry(memoryview(dev), layout, head, eh.ALGO, [])
        assert a.checksum == b.checksum and host == dev and b.hashed == layout.body


def test_without_the_c_build_the_cpu_path_keeps_two_passes_and_the_numpy_reference(tmp_path, monkeypatch):
    """A machine without a C compiler installs without the extension: ``--ft-store-checksum auto`` keeps
    ``xxh3_64`` on CPU, an ``mfh64`` store streams its entries (hashed on the NumPy reference, then written),
    and the copy that hashes refuses with the reason."""
    from moe_ft.snapshot.mapped import store_checksum

    monkeypatch.setattr(eh, "_native", None)
    monkeypatch.setattr(eh, "NATIVE", False)
    assert store_checksum(False, "arena", True, False) is None
    st = store(tmp_path, "numpy")
    assert not st.copies_hashing
    src = tensors(5)
    with st.begin(1) as p:
        p.put(OP, Level.FULL, src)
        assert p.touched >= 2 * sum(t.nbytes for t in src.values())
        p.put_meta({})
        p.publish()
    assert st.verify([1]).problems == ()
    with pytest.raises(RuntimeError, match="C extension"):
        eh.copy_lane_sums(src["weight"], torch.empty(src["weight"].nbytes, dtype=torch.uint8), 0)
