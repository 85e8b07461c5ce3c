"""The fault-tolerance runtime: one ``StepHooks`` subclass the training loop calls.

Per iteration ``t`` (``docs/architecture.md``, ``docs/policies.md``)::
    routers record popularity per micro-batch         (PopularityRouter, installed via the layer spec)
    before_optimizer_step(t): engine.wait_copied()    (snapshot of t-1 off the weights: the stall)
    optimizer.step(t)
    on_step_end(t): popularity.end_iteration(t)       (summed over all ranks when the policy needs it)
                    components.on_iteration_end        (capacity boost pays its deficit off)
                    plan = policy.plan(t, popularity)
                    engine.submit(t, plan, metadata)   (copy overlaps forward/backward of t+1)
                    popularity.mark_full(t, FULL experts)
                    components.after_snapshot          (replicas, durable tier, trace)

The operator registry, the catalogue and the components are built once the optimizer has its state and
the first iteration's time is measured (the policy's window and budgets derive from it, MoEvement Alg. 1,
MoEtion §4), i.e. at the end of the first iteration — or at start, before recovering. Mechanism and policy
stay apart: the runtime asks the policy for a plan and hands it to the engine.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from megatron.training.training import StepHooks, train_step
from moe_ft import comm
from moe_ft.cli.digest import write_digest
from moe_ft.config import FTConfig
from moe_ft.elastic.component import elastic_component
from moe_ft.elastic.holders import catalogue_infos
from moe_ft.elastic.inventory import read_records
from moe_ft.elastic.rebalance_component import rebalance_component
from moe_ft.launch.protocol import GROWS_ENV, REFUSED_EXIT_CODE, USAGE_EXIT_CODE
from moe_ft.launch.worker import launch_facts
from moe_ft.localized.component import UpstreamLogging
from moe_ft.localized.survivor import Regroup, SurvivorGuard
from moe_ft.localized.survivor_points import HeldPoint, StoredPoints, survivor_store
from moe_ft.megatron_ext.router import attach_popularity
from moe_ft.persist.durable import DurableTier
from moe_ft.persist.fit import other_world_error
from moe_ft.popularity import ExpertPopularity, PopularityConfig
from moe_ft.precision.te_fp8 import ensure_te_scaling_state
from moe_ft.recovery.component import Boost
from moe_ft.recovery.driver import recover, should_recover
from moe_ft.recovery.fresh_start import held_points, stale_store_error
from moe_ft.recovery.inputs import RecoveryInputs, last_fault_time
from moe_ft.recovery.planner import RecoveryRefused
from moe_ft.replication.component import Replicas
from moe_ft.runtime import components as C
from moe_ft.runtime.context import BuildContext
from moe_ft.runtime.log import format_line
from moe_ft.snapshot.bubble_component import BubbleScheduling
from moe_ft.snapshot.meta import capture_step_meta
from moe_ft.state.catalogue import gather_catalogue
from moe_ft.state.operators import Level
from moe_ft.state.optimizer_views import ensure_optimizer_state
from moe_ft.state.registry import OperatorRegistry
from moe_ft.store.capacity import RankNeed, existing_dir, mount_point, rank_need, shortfall

T = TypeVar("T")


class FTRuntime(StepHooks):
    """Builds the components from :class:`FTConfig` and runs the per-iteration sequence."""

    def __init__(self, config: FTConfig, carried: HeldPoint | None = None,
                 regroup: Callable[[], bool] | None = None) -> None:
        self.config = config
        self.carried = carried
        """The survivor point this process held when its previous attempt failed (``moe-ft launch``)."""
        self.regroup = regroup
        """``moe-ft launch``: whether the agents ask this process to leave its attempt (a node joins)."""
        self.registry = None
        self.catalogue = None
        self.popularity = None
        self.sessions: list = []
        """Snapshot sessions (policy + store + engine); one, except in the overhead benchmark."""
        self.active = None
        self.components: list[C.Component] = []
        self.clock = C.IterationClock()
        self.faults = None
        self.report = None
        self._recovered_at = None
        self.survivor = None
        """The survivor guard (``moe_ft/localized/survivor.py``; localized scope with snapshots), else ``None``.
        Upstream logging is a component (``moe_ft/localized/component.py``; pipeline parallelism, localized
        scope), found by ``find(UpstreamLogging)``."""

    def find(self, cls: type[T]) -> T | None:
        """The component of type ``cls`` (``None``: this job runs without it); the runtime keeps no named
        handles to its components."""
        return next((c for c in self.components if isinstance(c, cls)), None)

    @property
    def iteration_seconds(self) -> dict[int, float]:
        return self.clock.seconds

    # ------------------------------------------------------------------------------------ building
    def on_train_start(self, state, data, args, start_iteration: int) -> int:
        self._built_at = time.time()  # model and process groups exist (reform ends here after a failure)
        self.state, self.args = state, args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.start_iteration = start_iteration
        cfg = self.config
        comm.init_coordination()  # collective, same point on every rank: the host path's gloo group
        all_reduce = comm.all_reduce_world if cfg.needs_popularity else None
        # every layer is an MoE layer in this model; all_reduce over the world = sum over data-parallel
        # ranks (distinct tokens) and pipeline stages (distinct layers); TP is 1 (validated by arguments)
        self.popularity = ExpertPopularity(PopularityConfig(moe_layers=list(range(args.model.num_layers)),
                                                            num_experts=args.model.num_experts), all_reduce)
        if attach_popularity(state.model, self.popularity) == 0:
            raise RuntimeError("no PopularityRouter in the model: the layer spec was built without FTConfig "
                               "(pass the FT flags through pretrain_gpt_moe.extra_argument_groups)")
        elastic = elastic_component(args, self)  # --ft-elastic: layout records; a changed world is re-planned
        if elastic is not None:
            elastic.drop_older_generation()  # collective: a former spare's node holds an older generation's points
        resuming = elastic is not None and elastic.reshaping  # every operator from the old world's points
        recover, restart_count = False, 0
        if cfg.snapshot.enabled and cfg.persist.interval and not resuming:
            self._check_durable_tier(elastic is not None)  # collective, before the tier is read or changed
        if cfg.snapshot.enabled and not resuming:
            recover, restart_count = should_recover(cfg, args)  # collective: every rank decides alike
            # an elastic fallback (a world change no live copy serves) drops the old world's points itself
            fallback = elastic is not None and elastic.decision.kind == "fallback"
            if not recover and not fallback:
                self._check_fresh_store()  # collective, before anything is written into the job directory
        job_dir = Path(cfg.job_dir())
        job_dir.mkdir(parents=True, exist_ok=True)  # --ft-policy none builds no store that would create it
        self.faults = cfg.drill.build(str(job_dir))
        cfg.check_args(args)
        self.components = [self.clock, *cfg.recovery.build(state, self.popularity, rank=self.rank, runtime=self),
                           C.Progress(job_dir / f"progress_rank{self.rank}"),
                           *([C.CheckFreeNorms(state.model)] if C.CheckFreeNorms.wanted(args, cfg) else []),
                           *cfg.checkfree.build_components(state, rank=self.rank, job_dir=str(job_dir))]
        if cfg.drill.trace_out and self.rank == 0:
            boost = self.find(Boost)
            self.components.append(C.Trace(cfg.drill.trace_out, self.popularity, boost.boost if boost else None))
        if cfg.snapshot.enabled and cfg.recovery.recovery_scope == "localized":
            self.survivor = SurvivorGuard(store_root=cfg.snapshot.store_dir, job_id=cfg.snapshot.job_id,
                                          rank=self.rank, registry_fn=lambda: self.registry,
                                          fault_check=self.check_fault,
                                          deadline_s=cfg.recovery.survivor_deadline_s())
            self.survivor.watch_optimizer(state.optimizer)  # the critical section starts with the update
            self.survivor.carried = self.carried
            self.survivor.drain = lambda: [c.drain() for c in self.components]  # e.g. queued upstream logs

            if UpstreamLogging.wanted(args, cfg):  # collective: every rank decides alike
                self.components.append(UpstreamLogging.build(job_dir, self.rank))

        if elastic is not None:
            self.components.append(elastic)

            rebalance = rebalance_component(args, self, elastic)  # --ft-rebalance-interval: re-plan in the run
            if rebalance is not None:
                self.components.append(rebalance)
            elastic.report_fallback()  # a world change live copies cannot serve: the reason, then the usual path
        if elastic is not None and resuming:
            start_iteration = elastic.restore()  # every operator at the agreed point, onto the new plan
        elif recover:
            start_iteration = self._recover(state, data, args, start_iteration, restart_count)
        return start_iteration

    def _check_fresh_store(self) -> None:
        """Collective: a start that does not recover stops every rank with one line (exit 2) when the job's
        node-local store holds points of an earlier run under this ``--ft-job-id``
        (``moe_ft/recovery/fresh_start.py``): the first snapshot would collide with them."""
        cfg = self.config
        held = held_points(cfg.snapshot.store_dir, cfg.snapshot.job_id)
        self._stop_on_any(stale_store_error(cfg.job_dir(), held, cfg.recovery.recover) if held else "")

    def _check_durable_tier(self, elastic: bool) -> None:
        """Collective: a start whose durable tier holds complete points of another world size, newer than
        the ``--load`` checkpoint and than any of this world size, stops every rank with one line (exit 2)
        before anything reads or changes the tier (``moe_ft/persist/fit.py``): this world cannot load them,
        and its retention would delete them."""
        cfg = self.config
        root = cfg.persist.root(self.args.training.save)
        if not root:  # refused at parsing (an interval needs a directory)
            return
        tier = DurableTier(root, cfg.snapshot.job_id, self.world_size)
        hint = not elastic and bool(read_records(cfg.snapshot.store_dir, cfg.snapshot.job_id))
        self._stop_on_any(other_world_error(tier, newer_than=self.start_iteration - 1, elastic_hint=hint))

    def _stop_on_any(self, mine: str | None) -> None:
        """Collective: when any rank has an error line, the lowest such rank prints it and every rank stops
        (exit 2)."""
        errors = comm.all_gather_object(mine)
        if any(errors):
            if self.rank == next(r for r, e in enumerate(errors) if e):
                print(f"error: {next(e for e in errors if e)}", file=sys.stderr, flush=True)
            raise SystemExit(USAGE_EXIT_CODE)

    def build_context(self, t_iter_s: float) -> BuildContext:
        return BuildContext(state=self.state, args=self.args, rank=self.rank, world_size=self.world_size,
                            start_iteration=self.start_iteration, registry=self.registry, catalogue=self.catalogue,
                            popularity=self.popularity, t_iter_s=t_iter_s, clock=self.clock,
                            store_fault_hook=self._store_fault_hook)

    def build(self, t_iter_s: float) -> None:
        """Registry, catalogue, the snapshot session and the components that serve it (collective)."""

        # TE creates its delayed-scaling state at a module's first FP8 forward; a recovery builds the registry
        # on a rebuilt model before any: create it now, so that the registry lists it either way
        ensure_te_scaling_state(self.state.model)
        self.registry = OperatorRegistry.from_megatron(self.state.model, self.state.optimizer)
        # replicated experts (flexible dispatcher) are listed under their first holder's EP rank
        self.catalogue = gather_catalogue(catalogue_infos(self.registry.infos(), self.state.model),
                                          self.registry.ep_size)
        self._t_iter_s = t_iter_s
        ctx = self.build_context(t_iter_s)
        session = self.config.snapshot.build(ctx, replication=self.config.replication)
        self.sessions = [session] if session is not None else []
        self.active = session
        if session is not None and self.config.snapshot.snapshot_bubble_aware:
            self.components.append(BubbleScheduling.build(
                session, pipeline_size=self.args.parallel.pipeline_model_parallel_size,
                trace_out=self.config.drill.trace_out, rank=self.rank))
        for built in (self.config.replication.build(ctx, session), self.config.persist.build(ctx, session)):
            if built is not None:
                self.components.append(built)
        if session is not None and self.config.snapshot.checksum_by == "agent":
            self.components.append(self._agent_checksums(session))
        if session is not None:
            self._check_capacity()

    def _agent_checksums(self, session):
        """``--ft-checksum-by agent``: the node agent hashes the published points (``moe_ft/agent/verify.py``).
        Replicas are verified on arrival against the owner's digests, which this mode records only after
        publish: the node agent that replicates hashes a point before it sends it (``--ft-replicate-by
        agent``); the trainer's own replication is refused (every rank alike: replication is on or off, and by
        whom, for the whole job)."""
        # start-up time: the agent's client is imported only when the mode is on
        from moe_ft.agent.verify import AgentChecksums

        replicas = self.find(Replicas)
        if replicas is not None and replicas.replication is not None and self.config.replication.replicate_by != "agent":
            if self.rank == 0:
                print("error: --ft-checksum-by agent with replicas sent by the trainers: a replica is verified on "
                      "arrival against the owner's digests, which the node agent records only after publish; pass "
                      "--ft-replicate-by agent (the agent hashes a point before it sends it), --ft-replicas 0 or "
                      "--ft-checksum-by writer", file=sys.stderr, flush=True)
            raise SystemExit(USAGE_EXIT_CODE)
        return AgentChecksums(session.store, rank=self.rank,
                              agent_dir=os.path.join(session.store_root, session.job_id, "agent"),
                              idle_exit_s=self.config.persist.agent_idle_exit)

    def _check_capacity(self) -> None:
        """Collective: stop every rank with one line (exit 2) when the node-local stores cannot fit what the
        plan keeps (``moe_ft/store/capacity.py``)."""
        cfg = self.config
        store_dir = cfg.snapshot.store_dir
        registry = self.registry

        def nbytes(op, level) -> int:
            return sum(t.nbytes for t in registry[op].tensors(level).values()) if level != Level.NONE else 0

        full = sum(nbytes(op, Level.FULL) for op in registry)
        plans = self.active.policy.retained_plans()  # a sparse window's COMPUTE entries count too
        kept = None if plans is None else sum(nbytes(op, lvl) for plan in plans for op, lvl in plan.items()
                                              if op in registry)
        logs, replicas = self.find(UpstreamLogging), self.find(Replicas)
        replicating = replicas is not None and replicas.replication is not None
        need = rank_need(full, localized=self.survivor is not None,
                         replicas=cfg.replication.replicas if replicating else 0,
                         log_bytes=logs.stored_bytes_per_iteration() if logs is not None else 0,
                         window=getattr(self.active.policy, "window_length", None) or 1, kept_bytes=kept)
        mine = RankNeed(os.stat(existing_dir(store_dir)).st_dev, mount_point(Path(store_dir)), need)
        needs = [RankNeed(**d) for d in comm.all_gather_object(asdict(mine))]
        self._stop_on_any(shortfall(needs, store_dir, cfg.job_dir()))

    def reconfigure(self, iteration: int, change):
        """Collective, after ``iteration``'s optimizer step: ``change(registry)`` moves operators between
        ranks in place (an in-run rebalance, ``moe_ft/elastic/rebalance_component.py``) and returns ``(new
        registry, result)``; the catalogue, the snapshot sessions (the snapshot of ``iteration`` becomes a
        dense recovery point) and the components follow. Returns ``result``."""

        registry, result = change(self.registry)
        self.registry = registry
        self.catalogue = gather_catalogue(catalogue_infos(registry.infos(), self.state.model), registry.ep_size)
        for session in self.sessions:
            session.reconfigure(registry, iteration)
        for component in self.components:
            component.after_reconfigure(self.active)
        return result

    def build_session(self, snapshot_config, job_suffix: str = ""):
        """Another snapshot session over the same registry (the overhead benchmark compares policies)."""
        return snapshot_config.build(self.build_context(self._t_iter_s), job_suffix=job_suffix,
                                     replication=self.config.replication)

    # ------------------------------------------------------------------------ faults and recovery
    def check_fault(self, iteration: int, phase: str) -> None:
        """Failure drill: fire the fault scheduled at (this rank, ``iteration``, ``phase``), once."""
        if self.faults:
            logs = self.find(UpstreamLogging)
            upstream = logs.log_dir.root.parent if logs is not None else None
            self.faults.check(self.rank, iteration, phase, target=upstream)  # what corrupt-log damages

    def _in_recovery(self, iteration: int) -> bool:
        return self.report is not None and iteration <= self.report.failed["last_completed"]

    def _recover(self, state, data, args, start_iteration: int, restart_count: int) -> int:
        def step_fn(iteration, optimizer):
            return train_step(replace(state, optimizer=optimizer), data, iteration, args)

        ensure_optimizer_state(state.optimizer)  # the registry lists optimizer state: it must exist
        self.build(t_iter_s=1.0)
        try:
            self.report = recover(RecoveryInputs(
                config=self.config, state=state, args=args, rank=self.rank, world_size=self.world_size,
                start_iteration=start_iteration, restart_count=restart_count, step_fn=step_fn,
                registry=self.registry, popularity=self.popularity, session=self.active,
                components=tuple(self.components), faults=self.faults, check_fault=self.check_fault,
                survivor=self.survivor, survivor_points=self._survivor_points()))
        except RecoveryRefused as e:  # every rank refuses alike (--ft-min-recovery-level): one line, no traceback
            if self.rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(REFUSED_EXIT_CODE) from None
        self._launch_facts(self.report)
        for component in self.components:
            component.after_recovery(self.report, self.active)
        self._recovered_at = time.perf_counter()
        self.write_report(final=not self.report.reexecuted_iterations)
        return self.report.recovery_point["resume"]

    def _launch_facts(self, report) -> None:
        """Collective: how this attempt came about (``moe-ft launch``'s announcement: in-process or a full
        restart, pids kept) and, in drills, the fault-to-resume times (the slowest rank's)."""
        facts = launch_facts(self.world_size)
        if facts is not None:
            report.restart_kind, report.survivor_pids_kept = facts["kind"], facts["pids_kept"]
            report.fallback_reason = facts["reason"]
        fault_at = last_fault_time(self.faults)
        built = comm.max_over_ranks(int(self._built_at * 1e3)) / 1e3
        resumed = comm.max_over_ranks(int(time.time() * 1e3)) / 1e3
        if fault_at is None:
            return
        report.seconds["kill_to_resume"] = round(resumed - fault_at, 4)
        if facts is not None and facts.get("detected_at"):
            report.seconds["detect"] = round(facts["detected_at"] - fault_at, 4)
            report.seconds["reform"] = round(built - facts["detected_at"], 4)

    def _survivor_points(self):
        """Where this rank's survivor point is: held in memory when the process stayed since its last
        failure (and still has the same rank), else its node store."""
        if self.survivor is None:
            return None
        carried = self.survivor.carried
        if carried is not None and not carried.discarded and carried.rank == self.rank:
            return carried
        return StoredPoints(survivor_store(self.survivor.store_root, self.survivor.job_id, self.rank))

    def write_report(self, final: bool) -> None:
        if self.rank != 0:
            return
        if final:
            print(self.report.summary(), flush=True)
        self.report.write(self.config.report_dir())

    # ---------------------------------------------------------------------------------- iteration
    def on_step_begin(self, iteration: int) -> None:
        if self.survivor is not None:
            self.survivor.release()  # a hold not ended by after_log (e.g. the first iteration after a recovery)
        for component in self.components:
            component.on_step_begin(iteration)
        self.check_fault(iteration, "recovery" if self._in_recovery(iteration) else "forward")

    def after_log(self, iteration: int) -> None:
        if self.survivor is not None:
            self.survivor.release()  # a stop deferred since the step takes effect once the line is out
        # a node joins (moe-ft launch): every rank leaves at the end of the same iteration, holding its state
        if self.regroup is not None and comm.max_over_ranks(int(self.regroup())):
            raise Regroup(iteration)

    def before_optimizer_step(self, iteration: int) -> None:
        if not self._in_recovery(iteration):
            self.check_fault(iteration, "backward")
        for session in self.sessions:
            session.engine.wait_copied()

    def on_step_end(self, iteration: int, result) -> None:
        replaying = self._in_recovery(iteration)
        if not replaying:
            self.check_fault(iteration, "step")
        self.popularity.end_iteration(iteration)
        for component in self.components:
            component.on_iteration_end(iteration, replaying)
        if self.registry is None:  # the first iteration's time, agreed (every rank derives the same plan)
            self.build(t_iter_s=self.clock.agree(result.seconds))
        t_iter = self.clock.tick()  # collective every few iterations: the same iterations on every rank
        if t_iter is not None:
            for s in self.sessions:
                s.policy.observe_iteration_time(t_iter)
        session = self.select_session(iteration)
        plan = self._snapshot(iteration, result, session, replaying) if session is not None else {}
        for component in self.components:
            component.after_snapshot(iteration, plan, session, replaying)
        self._log(iteration, session)
        for component in self.components:
            component.after_iteration(iteration)
        if self.report is not None and iteration == self.report.failed["last_completed"]:
            self.report.seconds["reexecute"] = round(time.perf_counter() - self._recovered_at, 4)
            self.write_report(final=True)

    def _snapshot(self, iteration: int, result, session, replaying: bool):
        plan = session.policy.plan(iteration, self.popularity)
        session.last_plan = plan
        t = self.args.training
        meta, tensors = capture_step_meta(iteration=iteration, result=result, state=self.state,
                                          global_batch_size=t.global_batch_size, clip_grad=t.clip_grad,
                                          policy=session.policy, popularity=self.popularity)
        meta["policy_name"] = session.name
        meta["seed"] = t.seed  # the data order a recovery's replay must redo (moe_ft/recovery/schedule.py)
        for component in self.components:
            tensors.update(component.snapshot_tensors())
        if self.survivor is not None:  # iteration completed: a stop from now on publishes this state
            self.survivor.completed(iteration, meta, tensors, hold=True)  # until the loop logged it
        self.on_snapshot(iteration, plan)
        remote = frozenset().union(*(component.remote_full(iteration, plan) for component in self.components))
        session.engine.submit(iteration, plan, meta, tensors, remote)
        if not replaying:
            self.check_fault(iteration, "snapshot")  # the copy is in flight on the engine's thread
        self.popularity.mark_full(iteration, [op for op, lvl in plan.items() if lvl == Level.FULL])
        return plan

    def during_checkpoint_write(self, iteration: int) -> None:
        """The ``--save`` checkpoint after ``iteration`` iterations has its shards on disk but is not
        finalized: a ``persist`` fault of the iteration that ended there fires now (a torn checkpoint)."""
        if not self._in_recovery(iteration - 1):
            self.check_fault(iteration - 1, "persist")

    def select_session(self, iteration: int):
        """The session that snapshots ``iteration`` (one here; the benchmark alternates)."""
        return self.active

    def on_snapshot(self, iteration: int, plan) -> None:
        """Called on the training thread right before the engine starts copying (tests capture here)."""

    def _store_fault_hook(self, phase: str, iteration: int, name: str) -> None:
        if phase == "before_commit" and not self._in_recovery(iteration):
            self.check_fault(iteration, "publish")  # everything written, the rename not yet done
        if phase == "after_commit" and self.faults and not self._in_recovery(iteration):
            # the point just published
            self.faults.check(self.rank, iteration, "published", target=(self.active.store.backend, iteration))

    def on_train_end(self, report) -> None:
        """Close every session and component, each even if one before it failed (a replication that cannot
        end its streams must not skip the durable tier's final flush); then the first failure is raised (the
        others are printed), after the digest."""
        self.clock.stop(report.last_iteration - 1)
        errors: list[Exception] = []
        for closer in [*(s.close for s in self.sessions), *(c.close for c in self.components)]:
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - raised below, once the others are closed
                errors.append(e)
        for e in errors[1:]:
            print(f"moe-ft: rank {self.rank}: closing at the end of training, also: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        if self.config.drill.digest_out:
            write_digest(self.config.drill.digest_out, self.state, report.last_iteration)
        if errors:
            raise errors[0]

    def survivor_point(self) -> HeldPoint | None:
        """After this attempt failed under ``moe-ft launch``: the survivor point the process keeps for its next
        attempt (the one held now, else the one it carried in and has not recovered from yet)."""
        guard = self.survivor
        if guard is not None and guard.held is not None:
            return guard.held
        carried = guard.carried if guard is not None else self.carried
        return carried if carried is not None and not carried.discarded else None

    def abandon(self) -> None:
        """This attempt failed and the process goes on to the next one (``moe-ft launch``): stop the
        snapshot engines and the components' background work, without the end-of-training steps (no
        digest, no final report). Errors are reported, not raised: the next attempt recovers from the
        published points whatever happened here."""
        for closer in [*(s.close for s in self.sessions), *(c.abandon for c in self.components)]:
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - the failed attempt's leftovers must not stop the next
                print(f"moe-ft launch: rank {self.rank}: closing the failed attempt: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
        comm.reset_coordination()

    # ------------------------------------------------------------------------------------ metrics
    def metrics(self, session) -> dict:
        """The FT log line's fields: the snapshot session's newest record, then every component's."""
        records = session.engine.records if session is not None else []
        rec = records[-1] if records else None
        out = {"policy": session.name if session is not None else "none",
               "tokens_at_risk": float(self.popularity.since_full.sum())}
        if self.clock.t_iter_s is not None:
            out["t_iter_ms"] = 1e3 * self.clock.t_iter_s
        if rec is not None:
            prev = records[-2] if len(records) > 1 else None  # its copy overlapped this iteration
            out.update(bytes=rec.bytes, full=rec.num_full, compute=rec.num_compute,
                       stall_ms=1e3 * (prev.stall_s if prev else 0.0),
                       slot_wait_ms=1e3 * (prev.slot_wait_s if prev else 0.0))
            if prev is not None and prev.device_stall_s is not None:  # CUDA: the compute stream's wait
                out["device_stall_ms"] = 1e3 * prev.device_stall_s
            if prev is not None and prev.published:  # written while this iteration ran
                out.update(touched_per_byte=prev.trainer_payload_bytes_per_byte, thread_cpu_ms=1e3 * prev.thread_cpu_s)
            window = session.policy.window_progress(rec.iteration)
            if window is not None:
                out["window"] = window
        if session is not None and session.engine.paused:
            out["snapshots_paused"] = session.engine.paused
        if session is not None:
            out.update(session.metrics())
        for component in self.components:
            out.update(component.metrics(rec))
        return out

    def _log(self, iteration: int, session) -> None:
        interval = self.config.ft_log_interval or self.args.training.log_interval
        if self.rank != 0 or (iteration + 1) % interval:
            return
        print(format_line(iteration, self.metrics(session)), flush=True)


def build_runtime(args, carried: HeldPoint | None = None,
                  regroup: Callable[[], bool] | None = None) -> FTRuntime | None:
    """The runtime for parsed ``args`` (``None`` when ``--ft`` is off). Under ``moe-ft launch``: ``carried``,
    the survivor point this process held when its previous attempt failed; ``regroup``, whether the agents
    ask it to leave its attempt (nodes may join)."""
    config = args.extra.get("FTConfig")
    if config is None or not config.ft:
        return None
    return FTRuntime(config, carried, regroup if os.environ.get(GROWS_ENV) else None)
