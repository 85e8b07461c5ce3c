"""Parse-time checks of the ``--load`` checkpoint against this run's flags (before any process group).

The global batch size must be the checkpoint's: the data position of iteration ``i`` is ``i`` x it.

The LR/WD schedule (Megatron-LM's rule): by default the checkpoint's schedule must equal the one the flags
give, else the run stops naming the flag; ``--override-opt-param-scheduler`` trains with the flags' schedule
from the checkpoint's position, ``--use-checkpoint-opt-param-scheduler`` with the checkpoint's.
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


def _iters(steps: int, gbs: int) -> str:
    return str(steps // gbs) if steps % gbs == 0 else f"{steps} samples"


def schedule_mismatch(saved: dict[str, Any], flags: dict[str, Any], gbs: int, path: str) -> str | None:
    """One line naming the first flag whose value differs from the checkpoint's scheduler state ``saved``,
    or ``None``."""
    for key, flag in SCHEDULE_FLAGS.items():
        mine, theirs = flags[key], saved.get(key)
        if theirs is None or mine == theirs:
            continue
        if key in IN_SAMPLES:
            mine, theirs = _iters(mine, gbs), _iters(theirs, gbs)
        return (f"{flag} is {mine} here but {theirs} in the LR schedule of {path}: pass "
                f"--override-opt-param-scheduler to train on with the flags' schedule, or "
                f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    return None


def check_resume(t) -> str | None:
    """What refuses ``--load`` (``t``: validated ``TrainingArgs``) with these flags, in one line, or ``None``."""
    _, path = latest_checkpoint(t.load)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # noqa: BLE001 - many types; the message names the file
        return f"--load {t.load}: cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    saved_gbs = common.get("global_batch_size")  # absent from checkpoints saved before it was recorded
    if saved_gbs is not None and saved_gbs != t.global_batch_size:
        # the data position of iteration i is i x the global batch size (ReplayableData): another size
        # replays or skips samples; its default, --micro-batch-size x data-parallel size, follows the world
        return (f"--global-batch-size {t.global_batch_size} differs from the {saved_gbs} that {path} was trained "
                f"with (the resumed run would replay or skip data): pass --global-batch-size {saved_gbs}")
    if t.override_opt_param_scheduler or t.use_checkpoint_opt_param_scheduler or "scheduler" not in common:
        return None
    return schedule_mismatch(common["scheduler"], flag_schedule(t), t.global_batch_size, path)
