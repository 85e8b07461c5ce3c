"""A relaunch that cannot load the durable tier's points stops with one line (exit 2) before anything is
deleted: points of another world size (``moe_ft/persist/fit.py``: ``other_world_error``, checked by the
runtime before the tier is read), points of another model (``durable_misfit``, the recovery's first step).

Before, a 1-rank relaunch on the points of a 2-rank run logged "ignoring the complete point ... written by 2
ranks, this job has 1" twice per rank, trained from iteration 1, and its start (``discard_after``) and
retention deleted the 2-rank points; a relaunch with ``--num-experts 8`` on points of 4 experts started over
("no recovery point in every rank's node-local store") and its retention replaced them; one with
``--hidden-size 64`` stopped with a ``ValueError`` traceback from the restore.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_ft.persist import DurableTier, PersistWriter
from moe_ft.persist.component import Durable
from moe_ft.persist.fit import durable_misfit, other_world_error
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, StoreConfig
from tests._ft_helpers import tiny_model_flags, torchrun

OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0)]


def _complete_point(tmp_path, world: int, iterations=(1, 3)) -> DurableTier:
    """A durable tier of ``world`` ranks with complete dense points ending at ``iterations``."""
    tier = DurableTier(tmp_path / "durable", "j", world)
    rule = DenseRule(operators=frozenset(OPS))
    stores = [StoreConfig(root=str(tmp_path / f"shm{world}"), job_id="j", rank=r).build() for r in range(world)]
    writers = [PersistWriter(s, tier, rule, rank=r, interval=2) for r, s in enumerate(stores)]
    for it in iterations:
        for s in stores:
            with s.begin(it) as point:
                for op in OPS:
                    point.put(op, Level.FULL, {"w": torch.full((8,), float(it))})
                point.put_meta({"iteration": it})
                point.publish()
        for w in writers:
            w.persist(it)
    for w in writers:
        w.close()
    return tier


def test_points_of_another_world_are_refused_and_never_deleted(tmp_path):
    """The line names the world that wrote them and the fixes; a start of another world size (an elastic
    reshape: no refusal) never deletes them at its start, only its own newer complete point supersedes them."""
    tier2 = _complete_point(tmp_path, 2)
    tier1 = DurableTier(tmp_path / "durable", "j", 1)
    line = other_world_error(tier1, newer_than=-1, elastic_hint=False)
    assert line == (f"the durable tier {tier1.directory} holds complete recovery points up to iteration 3 written "
                    f"by 2 ranks, and this job has 1 rank: it cannot load them (they split the state another way) "
                    f"and its retention would delete them; relaunch on 2 ranks to recover from them, pass a new "
                    f"--ft-job-id to start over, or delete {tier1.directory}")
    assert "--ft-elastic to reshape the node-local copies onto 1 rank" in other_world_error(
        tier1, newer_than=-1, elastic_hint=True)
    assert other_world_error(tier1, newer_than=3, elastic_hint=False) is None  # older than the --load checkpoint
    assert other_world_error(tier2, newer_than=-1, elastic_hint=False) is None

    before = tier2.store(0).points()
    assert before == [1, 3]
    config = SimpleNamespace(dir=str(tmp_path / "durable"), agent=False, interval=2, keep=2, publish_timeout=300.0)
    session = SimpleNamespace(job_id="j", store=StoreConfig(root=str(tmp_path / "shm1"), job_id="j", rank=0).build(),
                              retention_rule=DenseRule(operators=frozenset(OPS)), store_root=str(tmp_path / "shm1"),
                              policy=SimpleNamespace(dense_points=False))
    ctx = SimpleNamespace(world_size=1, rank=0, start_iteration=0, state=None, popularity=None)
    Durable.build(config, ctx, session).close()  # the 1-rank world's start (discard_after)
    assert tier2.store(0).points() == before and tier2.complete_points() == [1, 3]
    assert [tier2.complete(e).parts[0].end for e in (1, 3)] == [1, 3]


def test_a_point_of_another_model_is_found_from_its_manifests(tmp_path):
    """``durable_misfit``: an operator this model has and the point lacks, or a stored tensor of another
    shape; the tier is only read (no rank directory is created for a rank the tier lacks)."""
    tier = _complete_point(tmp_path, 1)

    class Registry(dict):
        """``{op: size}``: an operator holds one tensor ``w`` of that size at every level."""

        def __getitem__(self, op):
            return SimpleNamespace(tensors=lambda level, n=dict.__getitem__(self, op): {"w": torch.zeros(n)})

    assert durable_misfit(tier, 3, 0, Registry({op: 8 for op in OPS})) is None
    assert durable_misfit(tier, 3, 0, Registry({**{op: 8 for op in OPS}, OperatorId.expert_op(0, 1): 8})) == \
        "it holds no expert.L0.E1 of rank 0"
    assert durable_misfit(tier, 3, 0, Registry({OPS[0]: 16, OPS[1]: 8})) == \
        "dense.L0/w: stored float32[8], this model's float32[16]"
    assert durable_misfit(tier, 3, 1, Registry({op: 8 for op in OPS})) is None
    assert not (tier.directory / "rank1").exists()


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_relaunch_that_cannot_load_the_durable_points_stops_before_deleting_them(corpus, tmp_path):
    def flags(store: str, **model):
        return [*tiny_model_flags("single", train_iters=4, log_interval=1, **model), "--data-path", corpus, "--ft",
                "--ft-policy", "dense", "--ft-store-dir", str(tmp_path / store), "--ft-job-id", "job",
                "--ft-persist-interval", "2", "--ft-persist-dir", str(tmp_path / "durable")]

    torchrun("pretrain_gpt_moe.py", flags("store"), nproc=2, timeout=150)
    job = tmp_path / "durable" / "moe_ft" / "job"
    before = _tree(job)
    assert sorted(p.name for p in (job / "complete").iterdir()) == ["000000000001.json", "000000000003.json"]

    def refused(store: str, nproc: int, **model) -> str:
        proc = torchrun("pretrain_gpt_moe.py", flags(store, **model), nproc=nproc, timeout=150, check=False)
        out = proc.stdout + proc.stderr
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert "exitcode  : 2" in out and len(errors) == 1, out[-4000:]
        assert "Traceback" not in out.split(errors[0])[0] and "iteration " not in proc.stdout, out[-4000:]
        assert _tree(job) == before, "the durable points were changed"
        return errors[0]

    assert refused("store1", 1) == (
        f"error: the durable tier {job} holds complete recovery points up to iteration 3 written by 2 ranks, and "
        f"this job has 1 rank: it cannot load them (they split the state another way) and its retention would "
        f"delete them; relaunch on 2 ranks to recover from them, pass a new --ft-job-id to start over, or delete "
        f"{job}")
    fix = (f"relaunch with the model flags of the run that wrote it to recover from it, pass a new --ft-job-id to "
           f"start over, or delete {job}")
    line = refused("store2", 2, num_experts=8)
    assert line.startswith(f"error: the durable point ending at iteration 3 in {job} does not fit this model (")
    assert line.endswith(fix) and "it holds no expert.L0.E4, expert.L0.E5, expert.L0.E6, ..." in line, line
    line = refused("store3", 2, hidden_size=64, ffn_hidden_size=128)
    assert line.startswith(f"error: the durable point ending at iteration 3 in {job} does not fit this model (")
    assert line.endswith(fix) and "dense.L0/" in line, line


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_recovery_from_an_older_durable_point_names_the_point_it_restored(corpus, tmp_path):
    """Point 7's entry on rank 0 is damaged: the relaunch recovers from point 5 and says so. Before, the
    message named the newest complete point ("recovered from the newest complete durable point (iteration
    7)") while it had restored point 5."""
    flags = [*tiny_model_flags("single", train_iters=8, log_interval=1), "--data-path", corpus, "--ft",
             "--ft-policy", "dense", "--ft-job-id", "job", "--ft-persist-interval", "2", "--ft-persist-dir",
             str(tmp_path / "durable")]
    torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(tmp_path / "store")], nproc=2, timeout=150)
    job = tmp_path / "durable" / "moe_ft" / "job"
    blob = job / "rank0" / "points" / f"{7:012d}" / "output.full.ent"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    proc = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(tmp_path / "store2")], nproc=2,
                    timeout=150)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("moe-ft recovery |"))
    assert "recovery point durable [5, 5]" in line, line
    assert (f"recovered from the complete durable point ending at iteration 5 (the newer complete point ending at 7 "
            f"did not restore on every rank) in {job}") in line, line


def test_a_rank_whose_durable_directory_is_gone_reads_nothing_and_creates_nothing(tmp_path, capsys):
    """Every rank marked its part of points 1 and 3 done, then rank 1's directory was lost. Its recovery offers
    no durable point (every rank then passes the tier over alike, and the report says the tier did not restore),
    says why in one line, and leaves the tier as it found it: it used to open the tier for writing and create an
    empty ``rank1`` store, after which ``moe-ft inspect`` saw "0 published points" instead of a missing part."""
    import shutil

    from moe_ft.recovery.inputs import durable_store

    tier = _complete_point(tmp_path, 2)
    shutil.rmtree(tier.directory / "rank1")
    before = _tree(tier.directory)
    inputs = SimpleNamespace(
        rank=1, world_size=2, args=SimpleNamespace(training=SimpleNamespace(save=None)),
        config=SimpleNamespace(snapshot=SimpleNamespace(job_id="j"),
                               persist=SimpleNamespace(interval=2, root=lambda save: str(tmp_path / "durable"))))
    store, end = durable_store(inputs, newer_than=-1)
    assert end == 3 and store.points() == []
    assert "have no part of this rank" in capsys.readouterr().err
    assert _tree(tier.directory) == before and not (tier.directory / "rank1").exists()
    own, _ = durable_store(SimpleNamespace(**{**vars(inputs), "rank": 0}), newer_than=-1)
    assert own.points() == [1, 3]
