"""Durable tier (MoC §5.1): completeness across ranks, retention, verification, sparse windows."""

import json
import os
import subprocess
import sys

import pytest
import torch
from _ft_helpers import ROOT, damage_blob, tiny_model_flags

from moe_ft.persist import DurableTier, PersistWriter
from moe_ft.persist.config import DurableConfig
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, SparseWindowRule, StoreConfig

pytestmark = pytest.mark.timeout(60)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)]


def _tensors(rank, it, op, run=0):
    g = torch.Generator().manual_seed(hash((rank, it, str(op), run)) % 2**31)
    return {"w": torch.randn(64, generator=g), "exp_avg.w": torch.randn(64, generator=g)}


def _write(store, rank, it, plan, run=0):
    with store.begin(it) as point:
        for op, level in plan.items():
            point.put(op, level, _tensors(rank, it, op, run))
        point.put_meta({"it": it, "run": run})
        point.publish()


def _setup(tmp_path, world=2, **kw):
    stores = [StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=r).build() for r in range(world)]
    tier = DurableTier(tmp_path / "durable", "j", world)
    config = dict(interval=2, **kw)  # PersistWriter keywords
    return stores, tier, config


def test_dense_point_complete_only_when_every_rank_wrote_it(tmp_path):
    stores, tier, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS))
    writers = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(stores)]
    for it in range(4):
        for r, s in enumerate(stores):
            _write(s, r, it, {op: Level.FULL for op in OPS})
    assert writers[0].persist(3).complete is False
    assert tier.complete_points() == []  # rank 1 not durable yet
    record = writers[1].persist(3)
    assert record.complete and record.nbytes > 0
    done = tier.newest_complete()
    assert done.end == 3 and set(done.parts) == {0, 1}
    for r in range(2):
        durable = tier.store(r)
        assert durable.points() == [3] and not durable.verify().problems
        for op in OPS:  # bitwise, verified on load
            got = durable.load(3, op, Level.FULL)
            for name, t in _tensors(r, 3, op).items():
                assert torch.equal(got[name], t)
        assert stores[r].backend.read_blob(3, "expert.L0.E1.full.ent") == durable.backend.read_blob(3, "expert.L0.E1.full.ent")
    for w in writers:
        w.close()


def test_retention_keeps_newest_complete_while_next_in_flight(tmp_path):
    stores, tier, config = _setup(tmp_path, keep=1)
    rule = DenseRule(operators=frozenset(OPS))
    writers = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(stores)]
    for it in range(6):
        for r, s in enumerate(stores):
            _write(s, r, it, {op: Level.FULL for op in OPS})
    for w in writers:
        w.persist(1)
    for w in writers:
        w.persist(3)
    # rank 0 collected before rank 1 completed 3, so it still holds 1 until its next flush
    assert tier.complete_points() == [3] and tier.store(0).points() == [1, 3] and tier.store(1).points() == [3]
    writers[0].persist(5)  # rank 1 has not finished 5: 3 stays the newest complete point, with its data
    assert tier.complete_points() == [3]
    assert tier.store(0).points() == [3, 5] and tier.store(1).points() == [3]
    writers[1].persist(5)
    writers[0].persist(5)  # already durable: nothing copied again; gc drops 3
    assert tier.complete_points() == [5] and tier.store(0).points() == [5]
    for w in writers:
        w.close()


def test_corrupt_local_entry_is_never_made_durable(tmp_path):
    stores, tier, config = _setup(tmp_path, world=1)
    rule = DenseRule(operators=frozenset(OPS))
    writer = PersistWriter(stores[0], tier, rule, rank=0, **config)
    for it in range(2):
        _write(stores[0], 0, it, {op: Level.FULL for op in OPS})
    damage_blob(stores[0], 1, "expert.L0.E0.full.ent", lambda data: data[:300] + bytes([data[300] ^ 1]) + data[301:])
    record = writer.persist(1)
    assert record.end == 0  # fell back to the older, intact point
    assert tier.store(0).points() == [0]
    writer.close()


def test_sparse_window_and_background_thread(tmp_path):
    stores, tier, config = _setup(tmp_path, world=1, keep=1)
    ops = frozenset(OPS)
    rule = SparseWindowRule.aligned(ops, 2)
    writer = PersistWriter(stores[0], tier, rule, rank=0, **config)
    order = sorted(OPS)
    for it in range(4):  # window of 2: first slice FULL for order[:2] at w0, the rest at w0+1
        i = it % 2
        plan = {op: (Level.FULL if (k < 2) == (i == 0) else Level.COMPUTE) for k, op in enumerate(order)}
        if i == 1:
            plan = {op: (Level.FULL if k >= 2 else Level.NONE) for k, op in enumerate(order)}
            plan = {op: l for op, l in plan.items() if l != Level.NONE}
        _write(stores[0], 0, it, plan)
        writer.submit(it)
    writer.flush()
    assert [r.end for r in writer.records] == [1, 3]
    done = tier.newest_complete()
    assert (done.parts[0].start, done.end) == (2, 3)
    assert tier.store(0).points() == [2, 3]
    writer.close()


def test_config_errors():
    with pytest.raises(ValueError, match="--ft-persist-dir or --save"):
        DurableConfig(interval=5).resolved(None)
    assert DurableConfig(interval=5).resolved("/ckpt").dir == "/ckpt"  # --save
    with pytest.raises(ValueError, match="never deleted"):
        DurableConfig(keep=0)
    from moe_ft.config import FTConfig

    with pytest.raises(ValueError, match="--ft-persist-interval 1"):  # would never complete (aliasing)
        FTConfig.from_flags(ft=True, ft_policy="pec", ft_persist_interval=2)
    FTConfig.from_flags(ft=True, ft_policy="pec", ft_persist_interval=1)


def test_inspect_validate_durable_point(tmp_path, capsys):
    from moe_ft.cli.main import main

    stores, tier, config = _setup(tmp_path)
    ops = {0: [OPS[0], OPS[1]], 1: [OPS[0], OPS[2]]}  # EP=2: expert 0 on rank 0, expert 1 on rank 1
    writers = [PersistWriter(s, tier, DenseRule(operators=frozenset(ops[r])), rank=r, **config)
               for r, s in enumerate(stores)]
    for r, s in enumerate(stores):
        _write(s, r, 1, {op: Level.FULL for op in ops[r]})
        writers[r].persist(1)
    job = str(tier.directory)
    assert main(["inspect", job, "--validate", "--num-layers", "1", "--num-experts", "2"]) == 0
    assert "every entry verified" in capsys.readouterr().out
    assert main(["inspect", job, "--validate", "--num-layers", "1", "--num-experts", "3"]) == 1
    assert "expert.L0.E2: no FULL entry" in capsys.readouterr().out
    blob = tier.directory / "rank1" / "points" / f"{1:012d}" / "expert.L0.E1.full.ent"
    data = bytearray(blob.read_bytes())
    data[100] ^= 4
    blob.write_bytes(bytes(data))
    assert main(["inspect", job, "--validate", "--num-layers", "1", "--num-experts", "2"]) == 1
    out = capsys.readouterr().out
    assert "rank 1: iteration 1 expert.L0.E1@FULL" in out and "checksum" in out
    assert main(["inspect", str(tmp_path), "--validate", "--num-layers", "1", "--num-experts", "2"]) == 2
    for w in writers:
        w.close()


def test_pec_incremental_k_persist(tmp_path):
    """pec (MoC §5.1): each flush writes only policy.persist_plan's entries (K_persist experts per layer);
    the durable point is each operator's newest durable FULL, complete once every operator has one."""
    from moe_ft.store import NewestFullRule

    stores, tier, config = _setup(tmp_path, world=1, keep=1)
    writer = PersistWriter(stores[0], tier, NewestFullRule(operators=frozenset(OPS)), rank=0, **config)
    dense, e0, e1 = OPS
    for it in range(6):
        _write(stores[0], 0, it, {op: Level.FULL for op in OPS})
    first = writer.persist(1, {dense: Level.FULL, e0: Level.FULL})
    assert not first.complete and tier.complete_points() == []  # expert 1 not durable yet
    assert writer.persist(3, {dense: Level.FULL, e1: Level.FULL}).complete
    done = tier.newest_complete().parts[0]
    assert done.full_at == {dense: 3, e0: 1, e1: 3}
    assert set(tier.store(0).catalog([1]).point(1).entries) == {dense, e0}  # only the planned entries
    writer.submit(5, {dense: Level.FULL, e0: Level.FULL})
    writer.flush()
    assert tier.newest_complete().parts[0].full_at == {dense: 5, e0: 5, e1: 3}
    assert tier.store(0).points() == [3, 5]  # 1 holds nothing the newest point needs
    got = tier.store(0).load(3, e1, Level.FULL)
    assert torch.equal(got["w"], _tensors(0, 3, e1)["w"])
    writer.close()


class _InterleavedTier(DurableTier):
    """Rank 0's view of the tier (its own process): ``between`` runs once, right after the retention pass
    listed the complete points — another node's writer acting in that window."""

    between = None

    def complete_points(self):
        ends = super().complete_points()
        if self.between is not None:
            between, self.between = self.between, None
            between()
        return ends


def test_retention_tolerates_markers_dropped_by_another_rank(tmp_path):
    stores, _, config = _setup(tmp_path, keep=2)
    tiers = [_InterleavedTier(tmp_path / "durable", "j", 2), DurableTier(tmp_path / "durable", "j", 2)]
    rule = DenseRule(operators=frozenset(OPS))
    writers = [PersistWriter(s, tiers[r], rule, rank=r, **config) for r, s in enumerate(stores)]
    for it in range(6):
        for r, s in enumerate(stores):
            _write(s, r, it, {op: Level.FULL for op in OPS})
    for end in (1, 3):
        for w in writers:
            w.persist(end)
    # rank 0's gc lists [1, 3]; rank 1 then completes 5 and its gc drops complete/1 before rank 0 reads it
    tiers[0].between = lambda: writers[1].persist(5)
    record = writers[0].persist(5)
    assert not record.complete and tiers[1].complete_points() == [3, 5]
    writers[0].persist(5)  # the next pass settles rank 0 on the kept points
    for r in range(2):
        assert tiers[r].store(r).points() == [3, 5] and not tiers[r].store(r).verify().problems
    for w in writers:
        w.close()


def test_point_of_another_world_size_is_not_complete(tmp_path, caplog):
    """A job relaunched on 3 ranks finds the 2-rank job's complete point: not its own (its state is split
    differently), reported once; its flushes work, and its own first complete point supersedes it."""
    stores, tier2, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS))
    for it in range(2):
        for r, s in enumerate(stores):
            _write(s, r, it, {op: Level.FULL for op in OPS})
    for r, s in enumerate(stores):
        PersistWriter(s, tier2, rule, rank=r, **config).persist(1)
    assert tier2.complete_points() == [1]
    stores3 = [StoreConfig(root=str(tmp_path / "shm3"), job_id="j", rank=r).build() for r in range(3)]
    tier3 = DurableTier(tmp_path / "durable", "j", 3)
    writers = [PersistWriter(s, tier3, rule, rank=r, **config) for r, s in enumerate(stores3)]
    for it in range(4):
        for r, s in enumerate(stores3):
            _write(s, r, it, {op: Level.FULL for op in OPS})
    with caplog.at_level("WARNING", logger="moe_ft.persist"):
        assert writers[2].persist(3).complete is False  # rank 2's retention: no KeyError on the old point
        assert tier3.complete_points() == [] and tier3.newest_complete() is None
        assert tier3.complete_points() == []
    assert [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()] == [
        f"moe-ft durable tier: ignoring the complete point ending at 1: in {tier3.directory}, written by 2 ranks, "
        "this job has 3 ranks"]
    # rank 1's done marker of the old world does not complete the new world's point 1
    writers[2].persist(1)
    assert writers[0].persist(1).complete is False and tier3.complete_points() == []
    assert writers[0].persist(3).complete is False and writers[1].persist(3).complete is True
    assert tier3.complete_points() == [3] and tier3.newest_complete().world_size == 3
    writers[0].persist(3)  # retention drops the older, other-world marker
    assert tier3.recorded_points() == [3] and tier2.complete_points() == []
    # a marker written before the world size was recorded counts for the world its parts cover exactly
    marker = tier3.directory / "complete" / f"{3:012d}.json"
    data = json.loads(marker.read_text())
    del data["world_size"]
    marker.write_text(json.dumps(data))
    assert tier3.complete_points() == [3] and tier2.complete_points() == []
    for w in writers:
        w.close()


def test_staging_of_a_writer_killed_mid_copy_is_swept(tmp_path):
    """A writer process that dies mid-copy leaves the point's staging in the durable tier: the next writer
    of that rank sweeps it when it starts and after every flush."""
    tier = DurableTier(tmp_path / "durable", "j", 1)
    dead = ("import os, sys\nfrom moe_ft.persist import DurableTier\n"
            "w = DurableTier(sys.argv[1], 'j', 1).store(0).backend.begin_point(1)\n"
            "sink = w.open_blob('dense.L0.full.ent'); sink.write(b'x' * 100); sink.close()\n"
            "os._exit(0)\n")  # no commit, no abort: as if SIGKILLed
    subprocess.run([sys.executable, "-c", dead, str(tmp_path / "durable")], check=True, cwd=ROOT, timeout=60,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert [(s.iteration, s.live) for s in tier.store(0).staging()] == [(1, False)]
    stores, _, config = _setup(tmp_path, world=1)
    writer = PersistWriter(stores[0], tier, DenseRule(operators=frozenset(OPS)), rank=0, **config)
    assert tier.store(0).staging() == []
    dead_again = dead.replace("begin_point(1)", "begin_point(3)")
    subprocess.run([sys.executable, "-c", dead_again, str(tmp_path / "durable")], check=True, cwd=ROOT,
                   timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for it in range(2):
        _write(stores[0], 0, it, {op: Level.FULL for op in OPS})
    assert writer.persist(1).complete
    assert tier.store(0).staging() == [] and tier.store(0).points() == [1]
    writer.close()


def test_stray_and_damaged_files_in_complete_are_ignored(tmp_path, caplog):
    stores, tier, config = _setup(tmp_path, world=1)
    writer = PersistWriter(stores[0], tier, DenseRule(operators=frozenset(OPS)), rank=0, **config)
    for it in range(4):
        _write(stores[0], 0, it, {op: Level.FULL for op in OPS})
    writer.persist(1)
    writer.persist(3)
    folder = tier.directory / "complete"
    (folder / "README.json").write_text("{}")
    (folder / "notes").mkdir()
    (folder / f"{3:012d}.json").write_text('{"end": 3, "par')  # damaged after its atomic write
    (tier.directory / "rank0" / "done" / "README.json").write_text("{}")
    with caplog.at_level("WARNING", logger="moe_ft.persist"):
        assert tier.complete_points() == [1] and tier.newest_complete().end == 1
        assert tier.done_points(0) == [1, 3]
        assert tier.complete_points() == [1]
    assert len([r for r in caplog.records if "ending at 3: unreadable marker" in r.getMessage()]) == 1
    # a complete/ that cannot be listed: one line naming it, not a raw traceback from int()
    other = DurableTier(tmp_path / "other", "j", 1)
    other.directory.mkdir(parents=True)
    (other.directory / "complete").write_text("not a directory")
    with pytest.raises(RuntimeError, match=f"cannot list {other.directory / 'complete'}: "):
        other.complete_points()
    writer.close()


@pytest.mark.timeout(120)
def test_megatron_dense_copy_records_what_save_checkpoint_does(tmp_path, corpus, megatron_world):
    """The durable tier's Megatron-format copy carries the world size and padded vocabulary that
    ``load_checkpoint`` checks, as a ``--save`` checkpoint does: without the world size, ``--load`` on
    another number of ranks expected this world's per-rank RNG shards and failed."""
    # Megatron is imported here, not at the top: the other tests of this file never build a model
    from megatron.core import dist_checkpointing

    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import checkpoint_dir, save_checkpoint
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.optimizer_state import ensure_optimizer_state
    from moe_ft.persist.megatron_dense import MegatronDenseWriter

    args = parse_args([*tiny_model_flags(train_iters=4), "--data-path", corpus], world_size=1)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    ensure_optimizer_state(state.optimizer)
    writer = MegatronDenseWriter(str(tmp_path / "dense"), state)
    writer.save(2)
    writer.close()
    assert writer.saved == [2]
    save_checkpoint(str(tmp_path / "plain"), 2, state)
    dense, plain = (dist_checkpointing.load_common_state_dict(checkpoint_dir(str(tmp_path / kind), 2))
                    for kind in ("dense", "plain"))
    assert set(dense) == set(plain)
    assert (dense["world_size"], dense["padded_vocab_size"]) == (plain["world_size"], plain["padded_vocab_size"])


def _two_runs(tmp_path) -> dict[int, list]:
    """Two runs' node-local stores of 2 ranks each (other values per run), dense points 0 … 3."""
    runs = {}
    for run in (0, 1):
        runs[run] = [StoreConfig(root=str(tmp_path / f"shm{run}"), job_id="j", rank=r).build() for r in range(2)]
        for it in range(4):
            for r, s in enumerate(runs[run]):
                _write(s, r, it, {op: Level.FULL for op in OPS}, run=run)
    return runs


def test_a_point_of_another_run_is_replaced_not_reused(tmp_path):
    """Run A: rank 0 made point 3 durable, rank 1 was killed before its done marker (no complete point). The
    relaunch starts fresh as run B (other values) on new nodes: its point 3 must be run B's on every rank,
    never run A's bytes on rank 0 next to run B's on rank 1."""
    _, tier, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS))
    runs = _two_runs(tmp_path)
    assert not PersistWriter(runs[0][0], tier, rule, rank=0, **config).persist(3).complete
    writers = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(runs[1])]
    assert writers[0].persist(3).nbytes > 0 and writers[1].persist(3).complete
    for r in range(2):
        for op in OPS:
            got = tier.store(r).load(3, op, Level.FULL)
            assert all(torch.equal(got[name], t) for name, t in _tensors(r, 3, op, run=1).items())
        assert tier.store(r).load_meta(3).meta["run"] == 1
    assert writers[0].persist(3).nbytes == 0  # its own bytes: not copied again
    for w in writers:
        w.close()


def test_a_complete_point_is_unmarked_while_its_ranks_replace_it_with_another_timeline(tmp_path):
    """Point 3 is complete (both ranks, timeline 0). A lossy recovery rolled back before it and the new timeline
    (other values) is persisted again rank by rank: from the first rank's replacement until the last rank's,
    the point is not complete (it would restore rank 0 from one timeline and rank 1 from the other); then it
    is complete again, of the new timeline on every rank."""
    _, tier, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS))
    runs = _two_runs(tmp_path)
    first = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(runs[0])]
    assert not first[0].persist(3).complete and first[1].persist(3).complete
    assert tier.complete_points() == [3]
    again = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(runs[1])]
    assert again[0].persist(3).nbytes > 0
    assert tier.complete_points() == [], "rank 0 holds the new timeline, rank 1 the old one"
    assert again[1].persist(3).complete and tier.complete_points() == [3]
    for r in range(2):
        assert tier.store(r).load_meta(3).meta["run"] == 1
    for w in (*first, *again):
        w.close()


def test_a_fresh_run_drops_the_done_markers_an_earlier_run_left_past_its_start(tmp_path):
    """Run A: rank 0 made point 3 durable and marked it done, rank 1 was killed first (no complete point). Run B
    starts afresh and its rank 1 flushes point 3 first: the point must not become complete with rank 0's part
    from run A (the component drops, at its start, every done marker and partial point past the start that no
    complete point uses)."""
    from types import SimpleNamespace

    from moe_ft.persist.component import Durable

    _, tier, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS))
    runs = _two_runs(tmp_path)
    old = PersistWriter(runs[0][0], tier, rule, rank=0, **config)
    assert not old.persist(3).complete
    old.close()
    durable_config = SimpleNamespace(dir=str(tmp_path / "durable"), agent=False, interval=2, keep=2,
                                     publish_timeout=300.0)
    components = []
    for r, store in enumerate(runs[1]):  # run B's ranks build their components (a start from iteration 0)
        session = SimpleNamespace(job_id="j", store=store, retention_rule=rule, store_root=str(tmp_path / "shm1"),
                                  policy=SimpleNamespace(dense_points=False))
        ctx = SimpleNamespace(world_size=2, rank=r, start_iteration=0, state=None, popularity=None)
        components.append(Durable.build(durable_config, ctx, session))
    assert not components[1].writer.persist(3).complete, "rank 0's part would be run A's"
    assert components[0].writer.persist(3).complete
    for r in range(2):
        assert tier.store(r).load_meta(3).meta["run"] == 1
    for c in components:
        c.close()


def test_inspect_validate_reads_only_and_checks_older_points(tmp_path, capsys):
    """``--validate`` opens the tier read-only: a missing rank directory is one finding per point, never
    created (before, ``DurableTier.store`` created ``rank1/{FORMAT.json,points,staging,trash}`` and every
    operator of rank 1 was listed INVALID). A damaged newest point with a valid older one exits 0 and says
    that recovery uses the older one."""
    from moe_ft.cli.main import main

    stores, tier, config = _setup(tmp_path)
    rule = DenseRule(operators=frozenset(OPS[:2]))
    writers = [PersistWriter(s, tier, rule, rank=r, **config) for r, s in enumerate(stores)]
    for it in (1, 3):
        for r, s in enumerate(stores):
            _write(s, r, it, {op: Level.FULL for op in OPS[:2]})
            writers[r].persist(it)
    for w in writers:
        w.close()
    job = str(tier.directory)
    blob = tier.directory / "rank0" / "points" / f"{3:012d}" / "expert.L0.E0.full.ent"
    data = bytearray(blob.read_bytes())
    data[100] ^= 4
    blob.write_bytes(bytes(data))
    assert main(["inspect", job, "--validate", "--num-layers", "1", "--num-experts", "1"]) == 0
    out = capsys.readouterr().out
    assert "INVALID: point 3: rank 0: iteration 3 expert.L0.E0@FULL" in out
    assert out.endswith("durable point ending at iteration 1: every entry verified, 1 x 1 experts present; recovery "
                        "passes over the newer point(s) [3] and uses this one\n"), out

    import shutil

    shutil.rmtree(tier.directory / "rank1")
    assert main(["inspect", job, "--validate", "--num-layers", "1", "--num-experts", "1"]) == 1
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "rank 1" in line] == [
        f"INVALID: point {end}: rank 1 holds no part of point {end} ({tier.directory / 'rank1'} is missing or not a "
        "store)" for end in (3, 1)], out
    assert not (tier.directory / "rank1").exists()
