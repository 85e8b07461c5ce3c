"""moe-ft's recovery applies Megatron-LM's LR-schedule rule to the states it restores, as ``--load`` does
(``moe_ft/recovery/schedule.py``, ``megatron/training/resume_checks.py``).

Real restarts: a one-rank run with dense snapshots trains 4 iterations (global batch 2, ``--lr 3e-3``, cosine
decay over ``--lr-decay-iters 6``); copies of its store are then recovered with ``--ft-recover always`` by
runs of 6 iterations (the store keeps the metadata of 4 and 5):

* ``--lr 2e-3``, decay over ``--lr-decay-iters 8``: refused before anything is restored, one line naming
  ``--lr`` and both choices, exit 2, the store as it was;
* the same with ``--override-opt-param-scheduler``: the first resumed iteration (4) trains with the flags'
  schedule from the snapshot's position (its scheduler state and LR bitwise those a scheduler built from the
  flags gives there; the parameter groups' peak is the flags' ``--lr``);
* the same with ``--use-checkpoint-opt-param-scheduler``: the snapshot's schedule, continued;
* the snapshot's schedule in the flags (``--lr-decay-iters 6``): no flag needed, and the run ends bitwise
  equal to the previous one (same schedule, same batches, same state);
* another ``--seed`` (moe-ft's rule: the seed gives the data order the recovery redoes): refused, one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.resume_checks import take_flags_schedule
from moe_ft.recovery.schedule import ScheduleRule, saved_global_batch_size
from moe_ft.snapshot.restore import restore_meta
from moe_ft.store import StoreConfig
from tests._ft_helpers import tiny_model_flags, torchrun

GBS = 2
MODEL = tiny_model_flags(global_batch_size=GBS, lr="3e-3", min_lr="3e-4", lr_decay_style="cosine", log_interval=1)
FT = ["--ft", "--ft-policy", "dense", "--ft-job-id", "sched"]
OTHER = ["--train-iters", "6", "--lr-decay-iters", "8", "--lr", "2e-3", "--ft-recover", "always"]
"""A relaunch with another schedule: --lr 2e-3, decay over 8 iterations (the saved one: 3e-3 over 6)."""


def _scheduler(max_lr: float, decay_iters: int, optimizer=None) -> OptimizerParamScheduler:
    """The scheduler ``megatron/training/model.py`` builds for these flags (``--min-lr 3e-4``, cosine, no
    warm-up, ``--weight-decay 0.01``, 6 training iterations)."""
    optimizer = optimizer or torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return OptimizerParamScheduler(optimizer, init_lr=max_lr, max_lr=max_lr, min_lr=3e-4, lr_warmup_steps=0,
                                   lr_decay_steps=decay_iters * GBS, lr_decay_style="cosine", start_wd=0.01,
                                   end_wd=0.01, wd_incr_steps=6 * GBS, wd_incr_style="constant")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory) -> Path:
    """The store of the 4-iteration run (points 2 and 3 kept)."""
    store = tmp_path_factory.mktemp("sched") / "store"
    torchrun("pretrain_gpt_moe.py", [*MODEL, "--data-path", corpus, *FT, "--ft-store-dir", str(store),
                                     "--train-iters", "4", "--lr-decay-iters", "6"], nproc=1, timeout=120)
    return store


def _resume(saved: Path, tmp_path: Path, name: str, corpus: str, flags: list[str], check: bool = True):
    """Recover a copy of the saved store with ``flags``; ``(process, store copy)``."""
    store = tmp_path / name
    shutil.copytree(saved, store)
    proc = torchrun("pretrain_gpt_moe.py", [*MODEL, "--data-path", corpus, *FT, "--ft-store-dir", str(store),
                                            "--ft-digest-out", str(tmp_path / f"{name}.json"), *flags],
                    nproc=1, timeout=120, check=check)
    return proc, store


def _meta(store: Path, iteration: int) -> dict:
    return restore_meta(StoreConfig(root=str(store), job_id="sched", rank=0).build(), iteration)[0]


@pytest.mark.multiproc
@pytest.mark.timeout(300)  # five one-rank runs under torchrun
def test_a_restart_from_snapshots_follows_the_lr_schedule_rule(saved, corpus, tmp_path):
    snapshot = _meta(saved, 3)["scheduler"]
    assert snapshot["max_lr"] == 3e-3 and snapshot["lr_decay_steps"] == 6 * GBS and snapshot["num_steps"] == 4 * GBS

    before = _files(saved / "sched")
    refused, store = _resume(saved, tmp_path, "refused", corpus, OTHER, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --lr is 0.002 here but 0.003 in the LR schedule of the snapshot of iteration 3 in "
                      f"{store}/sched/rank0: pass --override-opt-param-scheduler to train on with the flags' "
                      f"schedule, or --use-checkpoint-opt-param-scheduler to keep the snapshot's"], refused.stderr[-3000:]
    assert "exitcode  : 2" in refused.stderr and "iteration " not in refused.stdout
    after = _files(store / "sched")
    assert {name: after.get(name) for name in before} == before  # nothing restored, fetched or deleted

    # --override-opt-param-scheduler: the flags' schedule (2e-3, decay over 8) from the snapshot's position
    _resume(saved, tmp_path, "override", corpus, [*OTHER, "--override-opt-param-scheduler"])
    first = _meta(tmp_path / "override", 4)
    flags = _scheduler(2e-3, 8)
    flags.num_steps = 5 * GBS  # after the first resumed iteration (its metadata: the state after its step)
    assert first["scheduler"] == flags.state_dict()
    assert first["lr"] == flags.get_lr({})  # the logged LR: the next step's, bitwise
    assert {(g["max_lr"], g["min_lr"]) for g in first["param_groups"]} == {(2e-3, 3e-4)}

    # --use-checkpoint-opt-param-scheduler: the snapshot's schedule (3e-3, decay over 6), continued
    _resume(saved, tmp_path, "checkpoint", corpus, [*OTHER, "--use-checkpoint-opt-param-scheduler"])
    first = _meta(tmp_path / "checkpoint", 4)
    kept = _scheduler(3e-3, 6)
    kept.num_steps = 5 * GBS
    assert first["scheduler"] == {**snapshot, "num_steps": 5 * GBS} == {**kept.state_dict(), "wd_incr_steps": 4 * GBS}
    assert first["lr"] == kept.get_lr({})
    assert {(g["max_lr"], g["min_lr"]) for g in first["param_groups"]} == {(3e-3, 3e-4)}

    # the snapshot's schedule given by the flags: it resumes without either flag, exactly as the run above
    _resume(saved, tmp_path, "same", corpus, ["--train-iters", "6", "--lr-decay-iters", "6", "--ft-recover", "always"])
    same = json.loads((tmp_path / "same.json").read_text())
    assert same == json.loads((tmp_path / "checkpoint.json").read_text())


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_restart_under_another_seed_is_refused_before_anything_is_restored(saved, corpus, tmp_path):
    """``--seed`` gives the data order of the iterations a recovery redoes: a relaunch under another seed
    used to recover and train on silently (a dense recovery: the lost iterations re-trained on other samples,
    the report saying exact; a sparse one: a traceback once the replay's routing diverged). Now one line,
    exit 2, the store as it was."""
    assert _meta(saved, 3)["seed"] == 1234  # Megatron's default --seed, which MODEL keeps
    before = _files(saved / "sched")
    refused, store = _resume(saved, tmp_path, "seed", corpus, ["--train-iters", "6", "--lr-decay-iters", "6",
                                                               "--ft-recover", "always", "--seed", "4321"], check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --seed is 4321 here but 1234 in the snapshot of iteration 3 in {store}/sched/rank0 "
                      "(a recovery redoes that run's iterations on the data order its seed gives): pass --seed 1234, "
                      "or change the seed by resuming from a --load checkpoint under a new --ft-job-id"], \
        refused.stderr[-3000:]
    assert "exitcode  : 2" in refused.stderr and "iteration " not in refused.stdout
    after = _files(store / "sched")
    assert {name: after.get(name) for name in before} == before  # nothing restored, fetched or deleted


def test_the_rule_refuses_another_seed_only_where_the_metadata_records_one():
    from megatron.training.arguments import TrainingArgs

    meta = {"iteration": 3, "consumed_samples": 8, "scheduler": _scheduler(3e-3, 6).state_dict(), "seed": 7}
    training = TrainingArgs(global_batch_size=2, train_iters=6, lr_decay_iters=6, min_lr=3e-4, seed=7)
    assert ScheduleRule(training=training).problem(meta, "S") is None
    training.seed = 8
    assert ScheduleRule(training=training).problem(meta, "S").startswith("--seed is 8 here but 7 in S (")
    del meta["seed"]  # metadata of a version that did not record the seed: nothing to compare
    assert ScheduleRule(training=training).problem(meta, "S") is None


def test_the_rule_reads_the_global_batch_size_from_the_snapshot_metadata():
    """``consumed_samples`` is ``(iteration + 1)`` x the global batch size of the run that wrote it; another
    size is refused whichever schedule flag is given (the data position would move)."""
    from megatron.training.arguments import TrainingArgs

    scheduler = _scheduler(3e-3, 8).state_dict()
    meta = {"iteration": 3, "consumed_samples": 8, "scheduler": scheduler}
    assert saved_global_batch_size(meta) == 2 and saved_global_batch_size({"iteration": 3}) is None
    training = TrainingArgs(global_batch_size=4, train_iters=8, lr_decay_iters=8, min_lr=3e-4,
                            use_checkpoint_opt_param_scheduler=True)
    assert ScheduleRule(training=training).problem(meta, "the snapshot of iteration 3 in S") == (
        "--global-batch-size 4 differs from the 2 that the snapshot of iteration 3 in S was trained with (the resumed "
        "run would replay or skip data): pass --global-batch-size 2")
    training.global_batch_size = 2
    assert ScheduleRule(training=training).problem(meta, "S") is None
    training.use_checkpoint_opt_param_scheduler = False
    assert ScheduleRule(training=training).problem(meta, "S") is None  # the flags' schedule is the saved one
    training.lr_decay_iters = 6
    assert ScheduleRule(training=training).problem(meta, "S").startswith(
        "--lr-decay-iters (default --train-iters) is 6 here but 8 in the LR schedule of S: ")


def test_taking_the_flags_schedule_sets_every_group():
    """``--override-opt-param-scheduler`` after a restore: the scheduler's values, each group's peak and floor
    (a group at the saved values, one boosted 1.1x by CheckFree keeping its ratio, one already at the flags'
    values: ``--no-load-optim``) and the next step's ``lr`` / ``weight_decay``, from the restored position."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    optimizer = torch.optim.SGD([{"params": [params[0]], "max_lr": 3e-3, "min_lr": 3e-4},
                                 {"params": [params[1]], "max_lr": 3e-3 * 1.1, "min_lr": 3e-4 * 1.1},
                                 {"params": [params[2]], "max_lr": 2e-3, "min_lr": 2e-4}], lr=0.0)
    restored = _scheduler(3e-3, 6, optimizer)
    restored.step(increment=4 * GBS)
    flags = {**_scheduler(2e-3, 8).state_dict(), "min_lr": 2e-4, "lr_decay_style": "linear", "start_wd": 0.1,
             "end_wd": 0.1}
    del flags["num_steps"]
    take_flags_schedule(restored, flags)
    assert restored.state_dict() == {**flags, "num_steps": 4 * GBS}
    plain, boosted, given = optimizer.param_groups
    assert (plain["max_lr"], plain["min_lr"]) == (given["max_lr"], given["min_lr"]) == (2e-3, 2e-4)
    assert boosted["max_lr"] == pytest.approx(2.2e-3, rel=1e-12) and boosted["min_lr"] == pytest.approx(2.2e-4, rel=1e-12)
    for group in optimizer.param_groups:
        assert group["lr"] == restored.get_lr(group) and group["weight_decay"] == 0.1
    assert plain["lr"] == 2e-4 + (1 - 0.5) * (2e-3 - 2e-4)  # linear, half-way through 8 iterations
