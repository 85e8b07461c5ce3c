"""``--load`` flags against the checkpoints a run saves itself: ``--no-load-optim``/``--no-load-rng`` apply to
the checkpoint a run starts from, not to the ones it saved (a restart loads its own optimizer and RNG state).
"""

import logging
import os
import shutil

import pytest
import torch
from _ft_helpers import tiny_model_flags, torchrun

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.initialize import set_seeds
from megatron.training.model import build_train_state
from megatron.training.optimizer_state import leaf_optimizers
from megatron.training.pretrain import build_data
from megatron.training.training import train_step
from moe_ft.cli.drill import LAYOUTS, TINY, read_digest


def _param_states(state) -> list[dict]:
    return [inner.state[p] for opt in leaf_optimizers(state.optimizer) for inner in [opt.optimizer]
            for group in inner.param_groups for p in group["params"]]


def _start(argv):
    """A process of the run with command line ``argv``: its flags, state (built, nothing loaded) and data."""
    args = parse_args(argv, world_size=1)
    set_seeds(args.training.seed)
    return args, build_train_state(args), build_data(args)


def _load(args, state) -> int:
    t = args.training
    return load_checkpoint(t.load, state, load_optim=not t.no_load_optim, load_rng=not t.no_load_rng)


@pytest.mark.timeout(180)
def test_no_load_flags_skip_only_another_runs_checkpoint(corpus, tmp_path, megatron_world, caplog):
    """A pretraining run saves iteration 2. A run started from a copy of it with ``--load D --save D
    --no-load-optim --no-load-rng`` loads the model alone (Adam's moments zero, its RNG as seeded), trains and
    saves iteration 3; a restart of that run (the same flags) loads iteration 3 *with* its optimizer and RNG
    states and says so in one line. Before, the restart reset Adam mid-run (a recovery then reported success
    with another result). A finetune (``--load P --save O --no-load-optim``) reloads ``P`` on every restart
    and keeps skipping its optimizer state.

    Also: a load without the optimizer state used to leave Megatron-Core's distributed optimizer one shared
    ``step`` tensor per inner Adam (its loading template loads its own state back into itself), so every
    iteration added the number of parameters to each parameter's step (Adam's bias correction went wrong)."""
    flags = [*tiny_model_flags(train_iters=4, global_batch_size=2, lr_decay_iters=8), "--use-distributed-optimizer",
             "--data-path", corpus]
    pretrained, job = str(tmp_path / "pretrained"), str(tmp_path / "job")
    args, state, data = _start([*flags, "--save", pretrained])
    for it in range(2):
        train_step(state, data, it, args)
    save_checkpoint(pretrained, 2, state)
    pretrained_moments = [s["exp_avg"].clone() for s in _param_states(state)]
    assert all(m.abs().sum() > 0 for m in pretrained_moments)
    shutil.copytree(pretrained, job)

    finetune = [*flags, "--load", job, "--save", job, "--no-load-optim", "--no-load-rng"]
    args, state, data = _start(finetune)
    torch.manual_seed(7)  # an RNG state that is neither the seeded one nor the checkpoint's
    rng_before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="megatron.training"):
        assert _load(args, state) == 2
    assert [r.getMessage() for r in caplog.records if "--no-load" in r.getMessage()] == [
        f"--no-load-optim/--no-load-rng: loading {job}/iter_0000002 without its optimizer state and RNG states "
        "(a checkpoint this run did not save)"]
    assert all(not s["exp_avg"].any() for s in _param_states(state))
    assert torch.equal(torch.get_rng_state(), rng_before)
    train_step(state, data, 2, args)
    assert {float(s["step"]) for s in _param_states(state)} == {1.0}  # one Adam step, not one per parameter
    save_checkpoint(job, 3, state)
    saved_moments = [s["exp_avg"].clone() for s in _param_states(state)]
    saved_rng = torch.get_rng_state()

    # a restart of the same run: its own checkpoint loads whole
    caplog.clear()
    args, state, data = _start(finetune)
    torch.manual_seed(7)
    with caplog.at_level(logging.WARNING, logger="megatron.training"):
        assert _load(args, state) == 3
    assert [r.getMessage() for r in caplog.records if "--no-load" in r.getMessage()] == [
        f"--no-load-optim/--no-load-rng: not applied to {job}/iter_0000003, which this run saved (a restart): its "
        "optimizer and RNG states are loaded; the flags apply to the checkpoint a run starts from"]
    assert all(torch.equal(a, b) for a, b in zip(saved_moments, (s["exp_avg"] for s in _param_states(state))))
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert {float(s["step"]) for s in _param_states(state)} == {1.0}

    # a finetune into another directory reloads the pretrained checkpoint on every restart: skipped each time
    for _ in range(2):
        args, state, data = _start([*flags, "--load", pretrained, "--save", str(tmp_path / "other"),
                                    "--no-load-optim"])
        assert _load(args, state) == 2
        assert all(not s["exp_avg"].any() for s in _param_states(state))


@pytest.mark.timeout(400)  # three two-rank launches under torchrun, one with a restart
def test_a_restart_under_ft_recovers_exactly_with_no_load_optim(corpus, tmp_path):
    """A fresh ``--load D --save D`` job starts from scratch. Then ``--load D --save D --no-load-optim
    --no-load-rng`` with ``--ft``, a rank killed at iteration 5 right
    after the checkpoint of iteration 4: the restart's ``--load`` falls on that checkpoint, which this run saved,
    so it loads its optimizer and RNG states, and the run ends bitwise equal to the fault-free run with the same
    flags. Before, the restart loaded it without them (Adam's moments reset mid-run), the recovery took that
    checkpoint as its point and reported success with another final state."""
    base, store = str(tmp_path / "base"), str(tmp_path / "store")
    job = [*TINY, *LAYOUTS["dp2ep2"], "--lr-decay-iters", "8", "--data-path", corpus]
    # the brought checkpoint, from a fresh --load D --save D job: no checkpoint in D yet, so it starts from
    # scratch with one line, as Megatron-LM (it stopped with exit 2)
    out = torchrun("pretrain_gpt_moe.py", [*job, "--train-iters", "3", "--load", base, "--save", base], nproc=2).stdout
    assert out.count(f"warning: --load {base}: no such directory: starting from scratch "
                     "(--exit-on-missing-checkpoint stops instead)") == 1
    assert "resumed from" not in out and os.path.isdir(os.path.join(base, "iter_0000003"))

    def run(name: str, faults: list[str]) -> str:
        ckpt, digest = str(tmp_path / name), str(tmp_path / f"{name}.json")
        shutil.copytree(base, ckpt)
        flags = [*job, "--train-iters", "7", "--load", ckpt, "--save", ckpt, "--save-interval", "4",
                 "--no-load-optim", "--no-load-rng", "--ft", "--ft-policy", "sparse", "--ft-store-dir", store,
                 "--ft-job-id", name, "--ft-sparse-window", "3", "--ft-recovery-scope", "global",
                 "--ft-digest-out", digest]
        proc = torchrun("pretrain_gpt_moe.py", [*flags, *[f for x in faults for f in ("--ft-fail", x)]], nproc=2,
                        max_restarts=1 if faults else 0, timeout=180)
        out = proc.stdout + proc.stderr
        assert out.count("a checkpoint this run did not save") == 1  # the first start's, on rank 0
        assert out.count("which this run saved (a restart)") == len(faults)
        if faults:  # the restart's --load: the checkpoint of iteration 4, this run's own
            assert f"resumed from {ckpt} at iteration 4" in out
        return read_digest(digest)

    assert run("faulty", ["1:5"]) == run("ref", [])
