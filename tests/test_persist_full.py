"""A durable directory without room (``ENOSPC``): the copies pause, training goes on, the newest complete
point stays intact, nothing torn is marked done or complete, and the copies resume when space returns.

Before, the in-process writer's ``OSError(28)`` ended the run (``RuntimeError: durable persistence of rank 1
failed``) and so did the Megatron-format copy's finalize (``megatron_dense.poll``) on a 2600 KiB tmpfs. The
error is injected at the durable store's blob write (deterministic, no mount needed)."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from moe_ft.persist import DurableTier, PersistWriter
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, StoreConfig
from tests._ft_helpers import tiny_model_flags

pytestmark = pytest.mark.timeout(120)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0)]


def _publish(store, it: int) -> None:
    with store.begin(it) as point:
        for op in OPS:
            point.put(op, Level.FULL, {"w": torch.full((4096,), float(it))})
        point.put_meta({"iteration": it})
        point.publish()


def _fill(backend, after_blobs: int = 1):
    """Make ``backend``'s next points fail with ``ENOSPC`` after ``after_blobs`` blobs; returns the undo."""
    begin = backend.begin_point

    def full_begin(iteration):
        writer = begin(iteration)
        open_blob, opened = writer.open_blob, []

        def open_full(name):
            opened.append(name)
            if len(opened) > after_blobs:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return open_blob(name)

        writer.open_blob = open_full
        return writer

    backend.begin_point = full_begin
    return lambda: setattr(backend, "begin_point", begin)


def test_a_full_durable_directory_pauses_the_copies_and_keeps_the_newest_point(tmp_path, capsys):
    tier = DurableTier(tmp_path / "durable", "j", 2)
    stores = [StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=r).build() for r in range(2)]
    writers = [PersistWriter(s, tier, DenseRule(operators=frozenset(OPS)), rank=r, interval=2) for r, s in
               enumerate(stores)]
    for it in (1, 3, 5):
        for s in stores:
            _publish(s, it)
    assert [w.persist(1).complete for w in writers] == [False, True]
    capsys.readouterr()

    undo = _fill(writers[0].durable.backend)
    assert writers[0].persist(3) is None and writers[0].paused == "persist dir full"
    assert writers[1].persist(3).complete is False  # rank 0's part is missing: never complete
    assert writers[0].persist(5) is None  # still full: no second line
    err = capsys.readouterr().err
    assert err.count("moe-ft durable copies paused") == 1, err
    assert (f"moe-ft durable copies paused (persist dir full) at iteration 3 on rank 0: {tier.directory}: "
            "No space left on device; training goes on, the newest complete durable point (iteration 1) is kept"
            ) in err
    assert tier.complete_points() == [1] and tier.store(0).points() == [1]
    assert not tier.store(0).staging() and not tier.store(0).verify([1]).problems

    # a marker write that finds no room: the marker is whole or absent, no temporary file stays
    real_fsync = os.fsync

    def full_fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = full_fsync
    try:
        with pytest.raises(OSError):
            tier.mark_done(0, tier.complete(1).parts[0])
    finally:
        os.fsync = real_fsync
    assert not [p for p in (tier.directory / "rank0" / "done").iterdir() if p.name.endswith(".tmp")]

    undo()
    assert writers[0].persist(5).complete is False and writers[1].persist(5).complete is True
    assert writers[0].paused == "" and "moe-ft durable copies resumed at iteration 5" in capsys.readouterr().err
    assert tier.complete_points()[-1] == 5
    for w in writers:
        w.close()


def test_a_megatron_format_copy_without_room_is_not_started(tmp_path, corpus, megatron_world, monkeypatch, capsys):
    """The dense policy's Megatron-format copy: a copy the file system has no room for is not started (a
    coordinator that ran out of space writing the metadata would stop alone, its peers waiting on it); the
    next one that fits is written and resumes the copies."""
    # Megatron is imported here, not at the top: the other tests of this file build no model
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.optimizer_state import ensure_optimizer_state
    from moe_ft.persist.megatron_dense import MegatronDenseWriter

    args = parse_args([*tiny_model_flags(train_iters=4), "--data-path", corpus], world_size=1)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    ensure_optimizer_state(state.optimizer)
    writer = MegatronDenseWriter(str(tmp_path / "dense"), state)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=2**20))
    writer.save(2)
    writer.poll()
    assert writer.paused == "persist dir full" and not (tmp_path / "dense" / "iter_0000002").exists()
    assert "moe-ft durable copies paused (persist dir full) at iteration 2" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", real)
    writer.save(4)
    writer.close()
    assert writer.saved == [4] and writer.paused == "" and writer.last_bytes > 0
    assert "moe-ft durable copies resumed at iteration 4" in capsys.readouterr().err


def test_a_point_the_local_retention_deletes_before_the_pin_skips_the_flush_in_one_line(tmp_path, caplog):
    """The writer pins the point it copies before it verifies and reads it; the node-local retention may delete
    it between the listing and the pin (a newer point superseded it). Before, the writer verified first and
    pinned after: a point deleted in between stopped training on both ranks (``AttributeError`` on
    ``catalog.point(it) is None``), after a warning per entry file that read like corruption."""
    tier = DurableTier(tmp_path / "durable", "j", 1)
    store = StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=0).build()
    writer = PersistWriter(store, tier, DenseRule(operators=frozenset(OPS)), rank=0, interval=2)
    for it in (1, 3):
        _publish(store, it)
    pin = store.pin

    def retention_first(iterations):  # the retention's deletion lands right before the pin
        iterations = list(iterations)
        if 3 in iterations and 3 in store.points():
            store.delete_point(3)
        return pin(iterations)

    store.pin = retention_first
    with caplog.at_level("WARNING"):
        assert writer.persist(3) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["moe-ft durable copy of iteration 3 skipped on rank 0: the node-local retention deleted point 3 "
                     "before it was pinned (newer points superseded it); the next due iteration copies a newer one"]
    assert tier.store(0).points() == [] and tier.complete_points() == []
    store.pin = pin
    _publish(store, 5)
    assert writer.persist(5).complete and tier.complete_points() == [5]
    writer.close()
