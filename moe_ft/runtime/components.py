"""The optional parts of the runtime as components with one set of hooks.

The runtime (``hooks.py``) calls every built component at the same points of an iteration and never asks
which ones exist. A component that does not care about a hook inherits the no-op. Each wraps a mechanism
that lives elsewhere; the components of the replication, the durable tier and recovery are in their
packages (``replication/component.py``, ``persist/component.py``, ``recovery/component.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from moe_ft import comm
from moe_ft.checkfree.average import local_grad_sq
from moe_ft.checkfree.recovery import GRAD_SQ
from moe_ft.recovery.progress import ProgressFile
from moe_ft.state.operators import Level
from moe_ft.store.errors import store_full


class Component:
    """Hooks in call order within an iteration; all optional."""

    def on_step_begin(self, iteration: int) -> None:
        """Before the iteration's forward pass."""

    def on_iteration_end(self, iteration: int, replaying: bool) -> None:
        """After the optimizer step, once the popularity counters of ``iteration`` are final."""

    def snapshot_tensors(self) -> dict:
        """Extra metadata tensors saved with the snapshot of this iteration (restored by recovery)."""
        return {}

    def remote_full(self, iteration: int, plan) -> frozenset:
        """Operators FULL in ``plan`` whose FULL state other ranks rebuild, so this rank's snapshot holds
        only their compute weights and a checksum (optimizer recomputation, ``Replicas``)."""
        return frozenset()

    def after_snapshot(self, iteration: int, plan, session, replaying: bool) -> None:
        """After the engine took the snapshot of ``iteration`` (``plan`` empty without snapshots)."""

    def after_iteration(self, iteration: int) -> None:
        """At the very end of the iteration (progress records)."""

    def after_recovery(self, report, session) -> None:
        """After a recovery resumed at ``report.recovery_point['resume']`` (abandoned timeline dropped)."""

    def after_reconfigure(self, session) -> None:
        """The rank's operators changed inside the run (an in-run rebalance moved experts; the runtime's
        registry and ``session`` follow it already)."""

    def metrics(self, record) -> dict:
        """Fields of the FT log line; ``record``: the engine's newest :class:`SnapshotRecord` or ``None``."""
        return {}

    def drain(self) -> None:
        """Finish the background work queued so far (the process is about to stop and publish its survivor
        point: what the component owes the recovery must be on the store)."""

    def close(self) -> None:
        """End of training: flush and stop background threads."""

    def abandon(self) -> None:
        """The attempt failed and this process goes on to the next one (``moe-ft launch``): stop background
        work without waiting on peers. Default: :meth:`close`."""
        self.close()


class Trace(Component):
    """``--ft-trace-out``: rank 0 appends the popularity counters and FULL experts of every iteration."""

    def __init__(self, path: str, popularity, boost=None) -> None:
        self.path, self.popularity, self.boost = path, popularity, boost

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        full = sorted([op.layer, op.expert] for op, lvl in plan.items() if lvl == Level.FULL and op.is_expert)
        line = {"iteration": iteration, "replay": replaying, "counts": self.popularity.last_counts.tolist(),
                "full_experts": full}
        if self.boost is not None:
            line["boost_deficit"] = self.boost.deficit.tolist()
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


class Progress(Component):
    """This rank's newest completed iteration in its job directory (recovery reads it back to report how
    many iterations the failure cost)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record = ProgressFile(path)

    def after_iteration(self, iteration: int) -> None:
        try:
            self.record.write(iteration)
        except OSError as e:  # the store's file system is full: the previous record stays, training goes on
            if not store_full(e):
                raise

    def close(self) -> None:
        self.record.close()


class IterationClock(Component):
    """Wall time of every iteration (``iteration_seconds``), measured between step begins, and ``T_iter``
    for the policies: the median of the newest ``window`` measured iterations, agreed over the ranks (the
    slowest rank's median: iterations are synchronous, and every rank must derive the same plan from it)
    every ``sync_every`` trained iterations. A restarted process measures its own iterations again."""

    def __init__(self, *, window: int = 8, sync_every: int = 8) -> None:
        self.seconds: dict[int, float] = {}
        self._start: float | None = None
        self.window, self.sync_every = window, sync_every
        self.t_iter_s: float | None = None
        """The agreed ``T_iter`` (``None`` until the first agreement)."""
        self._since_sync = 0

    def median_recent(self) -> float | None:
        """This rank's median over the newest measured iterations (``None`` before the first)."""

        recent = [self.seconds[t] for t in sorted(self.seconds)[-self.window:]]
        return statistics.median(recent) if recent else None

    def agree(self, local_s: float | None) -> float | None:
        """Collective: the slowest rank's value in microseconds (host path); ``None`` if no rank measured."""

        agreed = comm.max_over_ranks(-1 if local_s is None else int(round(local_s * 1e6)))
        return None if agreed < 0 else agreed / 1e6

    def tick(self) -> float | None:
        """After a trained iteration (collective every ``sync_every`` calls): a new agreed ``T_iter`` when
        one was agreed now, else ``None``."""
        self._since_sync += 1
        if self.t_iter_s is not None and self._since_sync < self.sync_every:
            return None
        self._since_sync = 0
        agreed = self.agree(self.median_recent())
        if agreed is not None:
            self.t_iter_s = agreed
        return agreed

    def on_step_begin(self, iteration: int) -> None:
        now = time.perf_counter()
        if self._start is not None:
            self.seconds[iteration - 1] = now - self._start
        self._start = now

    def stop(self, iteration: int) -> None:
        if self._start is not None:
            self.seconds[iteration] = time.perf_counter() - self._start


class CheckFreeNorms(Component):
    """CheckFree's ``w`` (§4.2, Alg. 1 lines 1-2): this rank's squared gradient norm over its transformer
    layers (not the embedding / output layer: ``average.local_grad_sq``) of every iteration, saved with its
    snapshot (``checkfree.grad_sq``) so that a neighbouring stage that loses every copy of its state can be
    rebuilt after the restart (``moe_ft/checkfree/recovery.py``)."""

    def __init__(self, model_chunks) -> None:
        self.model_chunks = model_chunks

    @staticmethod
    def wanted(args, config) -> bool:
        """An intermediate stage exists (pipeline size >= 3) and the user accepts approximate recoveries."""
        return (args.parallel.pipeline_model_parallel_size >= 3
                and config.recovery.min_recovery_level in ("approximate", "none"))

    def snapshot_tensors(self) -> dict:
        return {GRAD_SQ: local_grad_sq(self.model_chunks)}
