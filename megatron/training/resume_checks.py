"""A saved training state against this run's flags: the ``--load`` checkpoint (checked at parsing, before
any process group) and the snapshots moe-ft's recovery restores (``moe_ft/recovery/schedule.py``).

The global batch size must be the saved state's: the data position of iteration ``i`` is ``i`` x it.

The LR/WD schedule (Megatron-LM's rule): by default the saved schedule must equal the one the flags give,
else the run stops naming the flag; ``--override-opt-param-scheduler`` trains with the flags' schedule from
the saved position (:func:`take_flags_schedule`), ``--use-checkpoint-opt-param-scheduler`` with the saved one.
"""

from __future__ import annotations

from typing import Any

from megatron.core import dist_checkpointing

from megatron.training.checkpoint_tracker import latest_checkpoint

SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters (default --train-iters)", "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay", "end_wd": "--weight-decay",
}
"""``OptimizerParamScheduler.state_dict()`` keys the flags set, and the flag setting each. The weight-decay
increment length (``wd_incr_steps``, from ``--train-iters``) is left out: with the constant increment style
moe-ft builds it changes nothing, and a longer ``--train-iters`` with the same decay must resume."""
IN_SAMPLES = ("lr_warmup_steps", "lr_decay_steps")
"""Keys Megatron-Core counts in samples (iterations x global batch size)."""


def flag_schedule(t) -> dict[str, Any]:
    """The schedule the flags give (``t``: ``TrainingArgs``, validated), as the scheduler's state dict holds
    it; ``megatron/training/model.py`` builds the scheduler from it."""
    gbs = t.global_batch_size
    return {"max_lr": float(t.lr), "min_lr": t.min_lr, "lr_warmup_steps": t.lr_warmup_iters * gbs,
            "lr_decay_steps": t.lr_decay_iters * gbs, "lr_decay_style": t.lr_decay_style,
            "start_wd": t.weight_decay, "end_wd": t.weight_decay}


def flag_state(t) -> dict[str, Any]:
    """Every value of ``OptimizerParamScheduler.state_dict()`` the flags set (all but ``num_steps``, the
    position): :func:`flag_schedule` and the weight-decay increment (constant over ``--train-iters``)."""
    return {**flag_schedule(t), "wd_incr_steps": t.train_iters * t.global_batch_size, "wd_incr_style": "constant"}


def _iters(steps: int, gbs: int) -> str:
    return str(steps // gbs) if steps % gbs == 0 else f"{steps} samples"


def schedule_mismatch(saved: dict[str, Any], flags: dict[str, Any], gbs: int, path: str,
                      kind: str = "checkpoint") -> str | None:
    """One line naming the first flag whose value differs from the saved scheduler state ``saved`` (of
    ``path``, a ``kind``: checkpoint or snapshot), or ``None``."""
    for key, flag in SCHEDULE_FLAGS.items():
        mine, theirs = flags[key], saved.get(key)
        if theirs is None or mine == theirs:
            continue
        if key in IN_SAMPLES:
            mine, theirs = _iters(mine, gbs), _iters(theirs, gbs)
        return (f"{flag} is {mine} here but {theirs} in the LR schedule of {path}: pass "
                f"--override-opt-param-scheduler to train on with the flags' schedule, or "
                f"--use-checkpoint-opt-param-scheduler to keep the {kind}'s")
    return None


def saved_state_mismatch(t, *, scheduler: dict[str, Any] | None, global_batch_size: int | None, path: str,
                         kind: str = "checkpoint") -> str | None:
    """What refuses resuming from a saved state (``t``: validated ``TrainingArgs``; ``scheduler``: the
    saved ``OptimizerParamScheduler.state_dict()``; ``global_batch_size``: the size it was trained with;
    either ``None`` where the state does not record it) in one line, or ``None``. ``path`` names the state
    in the line; ``kind`` is what it is (checkpoint, snapshot)."""
    if global_batch_size is not None and global_batch_size != t.global_batch_size:
        # the data position of iteration i is i x the global batch size (ReplayableData): another size
        # replays or skips samples; its default, --micro-batch-size x data-parallel size, follows the world
        return (f"--global-batch-size {t.global_batch_size} differs from the {global_batch_size} that {path} was "
                f"trained with (the resumed run would replay or skip data): pass --global-batch-size "
                f"{global_batch_size}")
    if t.override_opt_param_scheduler or t.use_checkpoint_opt_param_scheduler or scheduler is None:
        return None
    return schedule_mismatch(scheduler, flag_schedule(t), t.global_batch_size, path, kind)


def check_resume(t) -> str | None:
    """What refuses ``--load`` (``t``: validated ``TrainingArgs``) with these flags, in one line, or ``None``."""
    _, path = latest_checkpoint(t.load)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # noqa: BLE001 - many types; the message names the file
        return f"--load {t.load}: cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    # the global batch size is absent from checkpoints saved before it was recorded
    return saved_state_mismatch(t, scheduler=common.get("scheduler"), global_batch_size=common.get("global_batch_size"),
                                path=path)


def take_flags_schedule(scheduler, flags: dict[str, Any]) -> None:
    """``--override-opt-param-scheduler``, once a saved state is restored into ``scheduler`` (Megatron-Core's
    ``OptimizerParamScheduler``, built to take the values it is given) and its optimizer: the flags' schedule
    (``flags``: :func:`flag_state`) from the restored position. ``get_lr`` reads the peak and the floor from
    each parameter group's own ``max_lr``/``min_lr`` (Megatron sets them in every group; the optimizer's
    saved groups bring the saved run's back), so the groups take the flags' values too; a group whose values
    differ from the restored schedule's (a stage CheckFree boosted) keeps its ratio to them. Each group's
    ``lr`` and ``weight_decay`` are then set for the next step, as ``step`` sets them. A group that still
    holds the flags' values (``--no-load-optim``: the groups were not loaded) keeps them."""
    saved = scheduler.state_dict()
    scheduler.num_steps = 0  # load_state_dict *adds* the stored step count
    scheduler.load_state_dict({**saved, **flags})
    for group in scheduler.optimizer.param_groups:
        for key in ("max_lr", "min_lr"):
            if key in group:
                old, new = saved[key], flags[key]
                group[key] = new if group[key] in (old, new) or not old else group[key] / old * new
    scheduler.step(increment=0)
