"""Contract of the snapshot store, run against every backend. A later backend (peer replica, durable tier)
adds one harness class below: how to build a backend and how to damage a published blob in place."""

from __future__ import annotations

import logging
import threading
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch
from _ft_helpers import damage_arena_blob

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import (
    ArenaBackend,
    CorruptEntryError,
    DenseRule,
    KeepNewestRecoverable,
    LocalFSBackend,
    MemoryBackend,
    MissingEntryError,
    SnapshotStore,
)
from moe_ft.store.codec import DTYPES
from moe_ft.store.manifest import META_BLOB, entry_blob

Damage = Callable[[bytes], "bytes | None"]  # new contents, or None to delete the blob


class LocalHarness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self._n = tmp_path, 0

    def backend(self, **kw) -> LocalFSBackend:
        self._n += 1
        return LocalFSBackend(self.tmp_path / f"store{self._n}", **kw)

    def damage(self, store: SnapshotStore, iteration: int, blob: str, fn: Damage) -> None:
        path = store.backend.points_dir / f"{iteration:012d}" / blob
        new = fn(path.read_bytes())
        path.unlink() if new is None else path.write_bytes(new)


class ArenaHarness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self._n = tmp_path, 0

    def backend(self, **kw) -> ArenaBackend:
        self._n += 1
        return ArenaBackend(self.tmp_path / f"arena{self._n}", **kw)

    def damage(self, store: SnapshotStore, iteration: int, blob: str, fn: Damage) -> None:
        damage_arena_blob(store.backend, iteration, blob, fn)


class MemoryHarness:
    def __init__(self, tmp_path: Path) -> None:
        pass

    def backend(self, **kw) -> MemoryBackend:
        return MemoryBackend(**kw)

    def damage(self, store: SnapshotStore, iteration: int, blob: str, fn: Damage) -> None:
        blobs = store.backend._points[iteration]  # the in-memory analogue of editing the file
        new = fn(blobs[blob])
        blobs.pop(blob) if new is None else blobs.__setitem__(blob, new)


@pytest.fixture(params=[LocalHarness, ArenaHarness, MemoryHarness], ids=["local", "arena", "memory"])
def harness(request, tmp_path):
    return request.param(tmp_path)


@pytest.fixture
def store(harness):
    return SnapshotStore(harness.backend())


E0, E1, D0 = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1), OperatorId.dense(0)
OPS = [E0, E1, D0]


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern is possible (NaN payloads included): bitwise round trips must keep them."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def entry(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"weight": random_tensor(torch.bfloat16, (4, 8), gen),
            "master.weight": random_tensor(torch.float32, (4, 8), gen),
            "exp_avg.weight": random_tensor(torch.float32, (4, 8), gen)}


def entry_for(iteration: int, op: OperatorId) -> dict[str, torch.Tensor]:
    return entry(zlib.crc32(f"{iteration}/{op}".encode()))


def publish(store: SnapshotStore, iteration: int, levels: dict[OperatorId, Level], meta: bool = True):
    with store.begin(iteration) as point:
        for op, level in sorted(levels.items()):
            point.put(op, level, entry_for(iteration, op))
        if meta:
            point.put_meta({"iteration": iteration, "grad_norm": 0.1 * iteration},
                           {"rng.cpu": torch.Generator().manual_seed(iteration).get_state()})
        return point.publish()


def test_every_dtype_round_trips_bitwise(store):
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (3,), (5, 7), (2, 3, 4)]
    tensors = {f"{name}.{i}": random_tensor(dtype, shape, gen)
               for name, dtype in DTYPES.items() for i, shape in enumerate(shapes)}
    # fp8 data with its scale, as Transformer Engine keeps it (MoEvement §5.7)
    tensors["fp8.data"] = random_tensor(torch.uint8, (16, 16), gen)
    tensors["fp8.scale_inv"] = torch.tensor([0.0123], dtype=torch.float32)
    with store.begin(7) as point:
        point.put(E0, Level.FULL, tensors)
        point.put(E1, Level.COMPUTE, {"weight": tensors["bfloat16.3"]})
        point.put_meta({"loss_scale": 65536.0, "grad_norm": 0.1 + 0.2, "lr_step": 7, "nan": float("nan"),
                        "consumed_samples": 2**53 + 1, "popularity": [1, 2, 3]},
                       {"rng.cpu": torch.get_rng_state()})
        point.publish()
    loaded = store.load(7, E0, Level.FULL)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name
    assert same_bits(store.load(7, E1, Level.COMPUTE)["weight"], tensors["bfloat16.3"])
    meta = store.load_meta(7)
    assert meta.meta["grad_norm"] == 0.1 + 0.2 and meta.meta["consumed_samples"] == 2**53 + 1
    assert meta.meta["nan"] != meta.meta["nan"] and meta.meta["popularity"] == [1, 2, 3]
    assert torch.equal(meta.tensors["rng.cpu"], torch.get_rng_state())


def test_load_into_preallocated_buffers(store):
    publish(store, 1, {E0: Level.FULL})
    want = entry_for(1, E0)
    out = {name: torch.empty_like(t) for name, t in want.items()}
    got = store.load(1, E0, Level.FULL, out=out)
    assert all(got[n] is out[n] and same_bits(out[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="output buffer"):
        store.load(1, E0, Level.FULL, out={**out, "weight": torch.empty(4, 8, dtype=torch.float16)})


def test_rejects_bad_input(store):
    with store.begin(1) as point:
        with pytest.raises(ValueError, match="contiguous"):
            point.put(E0, Level.FULL, {"w": torch.zeros(4, 4).t()})
        with pytest.raises(ValueError, match="NONE"):
            point.put(E1, Level.NONE, {"w": torch.zeros(1)})
        point.put(D0, Level.COMPUTE, {"w": torch.zeros(1)})
        with pytest.raises(ValueError, match="already holds"):
            point.put(D0, Level.FULL, {"w": torch.zeros(1)})
        with pytest.raises(ValueError, match="JSON"):
            point.put_meta({"x": object()})
        point.publish()
    with pytest.raises(ValueError, match="already published"):
        store.begin(1)
    with pytest.raises(MissingEntryError):
        store.load(1, D0, Level.FULL)
    with pytest.raises(MissingEntryError):
        store.load(2, D0, Level.COMPUTE)


def test_point_invisible_until_publish_and_abort_leaves_nothing(store):
    publish(store, 1, {E0: Level.FULL})
    point = store.begin(2)
    point.put(E0, Level.FULL, entry(0))
    assert store.points() == [1]
    assert [s.iteration for s in store.staging()] == [2]
    point.abort()
    assert store.points() == [1] and store.staging() == []
    with store.begin(3) as point:
        point.put(E0, Level.FULL, entry(0))  # leaving the block without publish() aborts
    assert store.points() == [1] and store.staging() == []


def test_exception_before_commit_leaves_previous_points(harness):
    def hook(phase, iteration, name):
        if phase == "before_commit" and iteration == 2:
            raise RuntimeError("injected failure")

    store = SnapshotStore(harness.backend(fault_hook=hook))
    publish(store, 1, {op: Level.FULL for op in OPS})
    with pytest.raises(RuntimeError, match="injected"):
        publish(store, 2, {op: Level.FULL for op in OPS})
    assert store.points() == [1]
    assert store.verify().problems == ()
    assert store.newest_recoverable(DenseRule(operators=frozenset(OPS))).end == 1


def test_parallel_puts_from_threads(store):
    ops = [OperatorId.expert_op(layer, e) for layer in range(4) for e in range(4)]
    with store.begin(5) as point:
        threads = [threading.Thread(target=point.put, args=(op, Level.FULL, entry(i))) for i, op in enumerate(ops)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        point.publish()
    for i, op in enumerate(ops):
        assert all(same_bits(store.load(5, op, Level.FULL)[n], t) for n, t in entry(i).items())


FLIP = lambda data: data[:200] + bytes([data[200] ^ 0x01]) + data[201:]  # noqa: E731
FLIP_LAST = lambda data: data[:-30] + bytes([data[-30] ^ 0x80]) + data[-29:]  # noqa: E731
TRUNCATE = lambda data: data[: len(data) // 2]  # noqa: E731
DELETE = lambda data: None  # noqa: E731


@pytest.mark.parametrize("damage", [FLIP, FLIP_LAST, TRUNCATE, DELETE], ids=["flip", "flip_tail", "truncate", "delete"])
def test_damaged_entry_is_detected_and_skipped(harness, damage, caplog):
    store = SnapshotStore(harness.backend())
    for it in (1, 2):
        publish(store, it, {op: Level.FULL for op in OPS})
    harness.damage(store, 2, entry_blob(E1, Level.FULL), damage)
    with pytest.raises(CorruptEntryError, match="expert.L0.E1") as err:
        store.load(2, E1, Level.FULL)
    assert "iteration 2" in str(err.value) or damage in (TRUNCATE, DELETE)
    assert same_bits(store.load(2, E0, Level.FULL)["weight"], entry_for(2, E0)["weight"])  # neighbours fine
    with caplog.at_level(logging.WARNING, logger="moe_ft.store"):
        rp = store.newest_recoverable(DenseRule(operators=frozenset(OPS)), verify=True)
    assert rp.end == 1  # iteration 2 is no longer complete
    assert "expert.L0.E1@FULL" in caplog.text
    problems = store.verify().problems
    assert [(p.iteration, p.what) for p in problems] == [(2, "expert.L0.E1@FULL")]


@pytest.mark.parametrize("damage", [FLIP, TRUNCATE, DELETE], ids=["flip", "truncate", "delete"])
def test_damaged_manifest_or_meta_is_detected(harness, damage):
    store = SnapshotStore(harness.backend())
    for it in (1, 2, 3):
        publish(store, it, {E0: Level.FULL})
    harness.damage(store, 2, "MANIFEST.json", damage)
    harness.damage(store, 3, META_BLOB, damage)
    catalog = store.verify()
    assert catalog.iterations == [1, 3] and not catalog.has_meta(3)
    assert {(p.iteration, p.what) for p in catalog.problems} == {(2, "point"), (3, "meta")}
    with pytest.raises(CorruptEntryError, match="_meta.ent"):
        store.load_meta(3)
    with pytest.raises(MissingEntryError if damage is DELETE else CorruptEntryError):
        store.load(2, E0, Level.FULL)
    assert same_bits(store.load(3, E0, Level.FULL)["weight"], entry_for(3, E0)["weight"])


def test_entry_moved_under_another_key_is_rejected(harness):
    store = SnapshotStore(harness.backend())
    publish(store, 1, {E0: Level.FULL, E1: Level.FULL})
    publish(store, 2, {E0: Level.FULL, E1: Level.FULL})
    # Same size, valid file, but it belongs to iteration 1: the manifest checksum differs.
    harness.damage(store, 2, entry_blob(E1, Level.FULL), lambda _: store.backend.read_blob(1, entry_blob(E1, Level.FULL)))
    with pytest.raises(CorruptEntryError):
        store.load(2, E1, Level.FULL)


def test_gc_keeps_newest_complete_point_and_pins(harness):
    store = SnapshotStore(harness.backend(), retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
    publish(store, 1, {E0: Level.FULL})  # incomplete: nothing complete yet, nothing deleted
    publish(store, 2, {op: Level.FULL for op in OPS})
    assert store.points() == [2]
    publish(store, 3, {E0: Level.FULL})  # in flight: keep 2 (complete) and 3
    assert store.points() == [2, 3]
    with store.pin([3]):
        publish(store, 4, {op: Level.FULL for op in OPS})
        assert store.points() == [3, 4]
    publish(store, 5, {op: Level.FULL for op in OPS})
    assert store.points() == [5]
    assert store.discard_after(4) == [5] and store.points() == []


def test_republishing_after_rollback(store):
    publish(store, 1, {E0: Level.FULL})
    publish(store, 2, {E0: Level.FULL})
    assert [store.backend.has_point(i) for i in (0, 1, 2, 3)] == [False, True, True, False]
    with pytest.raises(ValueError, match="already published"):
        store.begin(2)  # a published point is not snapshotted again before the rollback discards it
    store.discard_after(1)
    assert [store.backend.has_point(i) for i in (1, 2)] == [True, False]
    publish(store, 2, {E0: Level.COMPUTE})
    assert store.catalog().level(2, E0) == Level.COMPUTE
