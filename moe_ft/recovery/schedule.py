"""Megatron-LM's LR-schedule rule for the states moe-ft's recovery restores, as ``--load`` applies it.

The rule is ``megatron/training/resume_checks.py``'s: the saved global batch size must be the flags' (the data
position of iteration ``i`` is ``i`` x it); the saved LR/WD schedule must equal the one the flags give, unless
``--override-opt-param-scheduler`` (train on with the flags' schedule from the saved position) or
``--use-checkpoint-opt-param-scheduler`` (keep the saved one). A recovery restores what some process saved
-- snapshots in the node-local stores, a survivor point, the durable tier, the copies an elastic reshape
moves -- and that process may have run with other flags: a relaunch with a longer ``--train-iters`` or another
``--lr``, or on another world whose default global batch size (micro-batch x data-parallel size) differs.

* :meth:`ScheduleRule.problem`: the one line that refuses one saved state's metadata (``moe_ft/snapshot/meta.py``:
  its ``scheduler`` state, the global batch size that wrote it, ``consumed_samples / (iteration + 1)``, and
  its ``--seed``). The seed is moe-ft's rule, not ``--load``'s: a recovery replays and re-trains iterations of
  the saved run (MoEvement §3.3: replay must redo each iteration exactly), and the data order of an iteration
  comes from the seed (the dataset's shuffle); under another seed a sparse recovery's replay diverges (it used
  to stop with a traceback only once the replay's routing differed, after the decision ledger had marked the
  point as failed) and a dense recovery re-trains its lost iterations on other samples. Megatron-LM's
  ``--load`` restores the RNG states and lets the seed change the data order from the checkpoint on: that
  remains the way to change the seed of a run.
* :func:`stop_unless_agreed` (collective): before anything is restored or a store changed, every rank has
  checked what it may restore from; any rank's refusal stops every rank, the line printed once, exit 2 (as a
  refused ``--load``, and before the recovery's decision ledger could record it as a failed decision).
* :meth:`ScheduleRule.after_restore`: with ``--override-opt-param-scheduler``, the flags' schedule from the
  restored position. Iterations a recovery replays ran with the saved schedule: they redo the past exactly,
  so the flags' schedule starts with the first iteration trained after the recovery.

Recoveries inside one run (``moe-ft launch``'s in-process attempts, a localized recovery, an in-run rebalance)
restore what the same flags saved: the schedule is the flags' (or, after a ``--load`` with
``--use-checkpoint-opt-param-scheduler``, the checkpoint's, with that flag still given), so they pass.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron.training.resume_checks import flag_state, saved_state_mismatch, take_flags_schedule
from moe_ft import comm
from moe_ft.launch.protocol import USAGE_EXIT_CODE
from moe_ft.snapshot.restore import restore_meta
from moe_ft.store.errors import StoreError

SavedState = Callable[[], "tuple[str, dict[str, Any]] | None"]
"""Reads one saved state: ``(what it is, for the message; its metadata)``, or ``None`` where there is none."""


def saved_global_batch_size(meta: dict[str, Any]) -> int | None:
    """The global batch size of the run that saved ``meta`` (``consumed_samples`` is ``(iteration + 1)`` x
    it), or ``None`` where the metadata does not say."""
    consumed, iteration = meta.get("consumed_samples"), meta.get("iteration")
    if consumed is None or iteration is None:
        return None
    return int(consumed) // (int(iteration) + 1)


@dataclass(kw_only=True, frozen=True)
class ScheduleRule:
    """The rule for this run's flags."""

    training: Any
    """Megatron's validated ``TrainingArgs`` (global batch size, schedule flags, the two choices)."""

    def problem(self, meta: dict[str, Any], where: str) -> str | None:
        """The line that refuses restoring the saved state of metadata ``meta`` (``where`` names it), or
        ``None``."""
        problem = saved_state_mismatch(self.training, scheduler=meta.get("scheduler"),
                                       global_batch_size=saved_global_batch_size(meta), path=where, kind="snapshot")
        saved_seed = meta.get("seed")  # None: metadata written before the seed was recorded
        if problem is None and saved_seed is not None and saved_seed != self.training.seed:
            problem = (f"--seed is {self.training.seed} here but {saved_seed} in {where} (a recovery redoes that "
                       f"run's iterations on the data order its seed gives): pass --seed {saved_seed}, or change "
                       "the seed by resuming from a --load checkpoint under a new --ft-job-id")
        return problem

    def first_problem(self, saved: Iterable[SavedState]) -> str | None:
        """The first refusing line over the states ``saved`` reads, or ``None``. A state that cannot be read
        is left to the recovery, which verifies every entry it restores and reports a corrupt one."""
        for read in saved:
            try:
                got = read()
            except (StoreError, OSError, ValueError, KeyError):
                continue
            if got is not None and (problem := self.problem(got[1], got[0])) is not None:
                return problem
        return None

    def after_restore(self, state) -> None:
        """Once the saved state is restored into ``state`` (the loop's ``TrainState``):
        ``--override-opt-param-scheduler`` trains on with the flags' schedule from its position."""
        if self.training.override_opt_param_scheduler:
            take_flags_schedule(state.scheduler, flag_state(self.training))


def stop_unless_agreed(problem: str | None, rank: int) -> None:
    """Collective: when any rank found a ``problem``, every rank stops (``SystemExit`` with the usage exit
    code, 2); rank 0 prints the lowest such rank's line."""
    problems = comm.all_gather_object(problem)
    first = next((p for p in problems if p is not None), None)
    if first is None:
        return
    if rank == 0:
        print(f"error: {first}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


def recovery_sources(store, *, lo: int, survivor_points=None, durable=None) -> list[SavedState]:
    """What a recovery may restore from on this rank: every point of the node-local ``store`` that ends at
    ``lo`` (the ``--load`` iteration - 1) or later, newest first; the survivor point (``survivor_points``,
    ``moe_ft/localized/survivor_points.py``; ``None``: localized scope off); the newest complete durable point
    (``durable``: ``(its store, its end)``, or ``None``)."""
    out = [_point(store, it, "snapshot") for it in reversed(store.points()) if it >= lo]
    if survivor_points is not None:
        out.append(survivor_points.newest_meta)
    if durable is not None:
        out.append(_point(durable[0], durable[1], "durable snapshot"))
    return out


def _point(store, iteration: int, kind: str) -> SavedState:
    return lambda: (f"the {kind} of iteration {iteration} in {store.backend.describe()}",
                    restore_meta(store, iteration)[0])
