"""Recovery's runtime components: the hang watchdog's beat and the MoEtion §6 capacity boost that makes up
the tokens a lossy recovery lost (``recovery/watchdog.py``, ``recovery/boost.py``)."""

from __future__ import annotations

from moe_ft.recovery.boost import record_made_up, snapshot_tensors, start_after_recovery
from moe_ft.runtime.components import Component


class Boost(Component):
    """MoEtion §6 capacity boost after a lossy recovery (``recovery/boost.py``)."""

    def __init__(self, boost, runtime) -> None:
        self.boost, self.runtime = boost, runtime

    def on_iteration_end(self, iteration: int, replaying: bool) -> None:
        """Pay the boosted experts' extra tokens off (collective while a boost is active); note in the
        recovery report when each expert made its lost tokens up."""

        made_up = self.boost.end_iteration(iteration)
        report = self.runtime.report
        section = report.capacity_boost if report is not None else None
        if made_up and section and record_made_up(section, made_up, iteration, self.boost.active):
            if self.runtime.rank == 0 and section.get("ended_at") is not None:
                print(f"moe-ft capacity boost: {len(section['experts'])} experts made up "
                      f"{section['tokens_to_make_up']:.0f} lost tokens by iteration {iteration}", flush=True)
            if not replaying:  # while re-executing, the final report write follows
                self.runtime.write_report(final=False)

    def snapshot_tensors(self) -> dict:
        return snapshot_tensors(self.boost)

    def after_recovery(self, report, session) -> None:
        report.capacity_boost = start_after_recovery(self.boost, report, session.store)

    def metrics(self, record) -> dict:
        if not self.boost.active:
            return {}
        return {"boost_experts": int((self.boost.deficit > 0).sum()), "boost_deficit": float(self.boost.deficit.sum())}


class HangWatch(Component):
    """Hang detection: a rank without progress for ``--ft-hang-timeout`` seconds exits (torchrun restarts)."""

    def __init__(self, watchdog) -> None:
        self.watchdog = watchdog

    def on_step_begin(self, iteration: int) -> None:
        self.watchdog.beat(iteration)

    def close(self) -> None:
        self.watchdog.close()
