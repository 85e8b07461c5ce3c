"""The recovery component's flags (``--ft-recover``, ``--ft-recovery-scope``, ``--ft-min-recovery-level``,
``--ft-hang-timeout``, ``--ft-capacity-boost``, ...) and what they build: the hang watchdog and the
capacity boost. Imported at flag parsing: nothing here imports Megatron-Core's model code."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron.training.argument_utils import field_help


@dataclass(kw_only=True)
class RecoverConfig:
    """What a (re)start does: recover or not, detect hangs, report, make lost tokens up."""

    recover: str = field(default="auto", metadata=field_help(
        "Recover from the node-local store at start: 'auto' = after a torchrun restart "
        "(TORCHELASTIC_RESTART_COUNT > 0 on any rank) or when the durable tier holds a complete point, "
        "'always', or 'never'.", choices=["auto", "always", "never"]))
    hang_timeout: float = field(default=0.0, metadata=field_help(
        "Seconds without iteration progress after which a rank declares itself hung and exits so torchrun "
        "restarts the job (0 = no watchdog)."))
    report_dir: str = field(default="", metadata=field_help(
        "Directory for recovery reports (JSON); empty = <ft-store-dir>/<ft-job-id>/reports."))
    capacity_boost: float = field(default=0.0, metadata=field_help(
        "MoEtion §6 capacity boost: after a pec/selective recovery, every expert restored from a stale FULL "
        "entry gets this fraction more capacity (0.1 = 10 %%) until it has kept as many extra tokens as the "
        "recovery lost for it (0 = off). Needs token dropping (--moe-expert-capacity-factor)."))
    min_recovery_level: str = field(default="none", metadata=field_help(
        "The worst correctness level a recovery may reach, else the job stops with a one-line error: 'exact' "
        "(sparse replay, own point, peer replica: bitwise), 'nondeterministic' (+ a replay with "
        "--no-deterministic: the same iterations on the same data, not bitwise), 'durable' (+ durable point or "
        "--load checkpoint), 'lossy' (+ pec/selective, PLT/MLT), 'approximate' (+ CheckFree rebuild of a lost "
        "pipeline stage), 'none' (+ starting over). Levels per operator are in the recovery report "
        "(moe_ft/recovery/planner.py).",
        choices=["exact", "nondeterministic", "durable", "lossy", "approximate", "none"]))
    survivor_deadline: float = field(default=0.0, metadata=field_help(
        "Seconds a stopped rank may spend publishing its survivor point before it gives up unpublished (0 = "
        "the launcher's SIGTERM-to-SIGKILL grace, TORCH_ELASTIC_SHUTDOWN_TIMEOUT or torch elastic's 30 s, "
        "minus 5 s)."))
    recovery_scope: str = field(default="localized", metadata=field_help(
        "Which ranks roll back after a failure: 'localized' = only the failed ranks' pipeline-stage "
        "data-parallel groups replay, fed by their neighbours' upstream logs, while the survivors load the "
        "state they published when the job stopped (MoEvement §3.4, App. A); it falls back to 'global' "
        "(every rank restores and replays) when a survivor point or a log is missing or corrupt, with the "
        "reason in the recovery report (moe_ft/localized/scope.py). Upstream logging runs only with "
        "'localized' and pipeline parallelism.", choices=["global", "localized"]))

    def __post_init__(self) -> None:
        if self.recovery_scope not in ("global", "localized"):
            raise ValueError(f"--ft-recovery-scope must be global or localized, got {self.recovery_scope!r}")
        if self.hang_timeout < 0:
            raise ValueError("--ft-hang-timeout must be >= 0 seconds")
        if self.survivor_deadline < 0:
            raise ValueError(f"--ft-survivor-deadline must be >= 0 seconds (0: derived), got {self.survivor_deadline}")
        if self.capacity_boost < 0:
            raise ValueError(f"--ft-capacity-boost must be >= 0 (a fraction, 0.1 = 10 %), got {self.capacity_boost}")
        if self.min_recovery_level not in ("exact", "nondeterministic", "durable", "lossy", "approximate", "none"):
            raise ValueError(f"--ft-min-recovery-level must be exact, nondeterministic, durable, lossy, approximate "
                             f"or none, got {self.min_recovery_level!r}")

    def check_args(self, args) -> None:
        """Checks against the model's flags (``FTConfig.check_args``, with ``--ft``): a replay is bitwise only
        with deterministic kernels, so ``--ft-min-recovery-level exact`` would refuse every replay of a
        ``--no-deterministic`` job (its replays reach level ``nondeterministic``, ``moe_ft/recovery/planner.py``)."""
        if self.min_recovery_level == "exact" and not args.training.deterministic:
            raise ValueError("--ft-min-recovery-level exact needs bitwise replays, but --no-deterministic lets "
                             "kernels differ from run to run (a replayed iteration is then not bitwise): drop "
                             "--no-deterministic, or pass --ft-min-recovery-level nondeterministic (or lower)")

    def build(self, state, popularity, *, rank: int, runtime) -> list:
        """The recovery components this start needs: the hang watchdog (``--ft-hang-timeout``) and the
        MoEtion §6 capacity boost attached to the routers (``--ft-capacity-boost``); ``runtime`` gives the
        boost the recovery report it updates."""
        out: list = []
        if not (self.hang_timeout or self.capacity_boost):
            return out

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.recovery.boost import build_capacity_boost
        from moe_ft.recovery.component import Boost, HangWatch
        from moe_ft.recovery.watchdog import Watchdog

        if self.hang_timeout:
            out.append(HangWatch(Watchdog(self.hang_timeout, rank)))
        if self.capacity_boost:
            out.append(Boost(build_capacity_boost(self.capacity_boost, state, popularity), runtime))
        return out

    def survivor_deadline_s(self) -> float:
        """``--ft-survivor-deadline``, or the launcher's grace between SIGTERM and SIGKILL minus 5 s (the
        dump must be published before the kill; at least 1 s)."""
        if self.survivor_deadline:
            return self.survivor_deadline
        grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        return max(1.0, grace - 5.0)
