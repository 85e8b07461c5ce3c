"""The fault-tolerance runtime: one ``StepHooks`` subclass the training loop calls (SPEC §1 facade).

Per iteration ``t`` (``docs/policies.md`` call sequence, SPEC §2–§4)::

    routers record popularity per micro-batch        (PopularityRouter, installed via the layer spec)
    before_optimizer_step(t): engine.wait_copied()   (snapshot of t-1 off the weights: the stall)
    optimizer.step(t)
    on_step_end(t): popularity.end_iteration(t)      (all_reduce over all ranks when the policy needs it)
                    plan = policy.plan(t, popularity)
                    engine.submit(t, plan, metadata)  (copy overlaps forward/backward of t+1)
                    popularity.mark_full(t, FULL experts)

The registry, the global catalogue, the policy, the store and the engine are built at the end of the
first iteration (torch's Adam creates its state in the first step). Mechanism and policy stay apart: the
runtime asks the policy for a plan and hands it to the engine.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from megatron.training.training import StepHooks
from moe_ft.config import FTConfig
from moe_ft.state.operators import Level


class FTSession:
    """One policy with its store and engine (the benchmark runs several side by side)."""

    def __init__(self, name: str, policy, engine, store) -> None:
        self.name, self.policy, self.engine, self.store = name, policy, engine, store
        self.last_plan: dict = {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class FTRuntime(StepHooks):
    """Builds registry / popularity / policy / engine / store and runs the per-iteration sequence."""

    def __init__(self, config: FTConfig) -> None:
        self.config = config
        self.registry = None
        self.catalogue = None
        self.popularity = None
        self.sessions: list[FTSession] = []
        self.active: FTSession | None = None
        self.iteration_seconds: dict[int, float] = {}
        self._step_start = None
        self._first_iter_s = None
        self.faults = None
        self.watchdog = None
        self.report = None
        self._recovered_at = None
        self._progress = None
        self.replication = None
        self.persistence = None
        self.megatron_dense = None
        self.boost = None  # MoEtion §6 capacity boost (--ft-capacity-boost)

    # ------------------------------------------------------------------------------------ building
    def on_train_start(self, state, data, args, start_iteration: int) -> int:
        from moe_ft.megatron_ext.router import attach_popularity
        from moe_ft.popularity import ExpertPopularity, PopularityConfig

        self.state, self.args = state, args
        self.rank = dist.get_rank()
        all_reduce = (lambda t: dist.all_reduce(t)) if self.config.needs_popularity else None
        # every layer is an MoE layer in this model; all_reduce over the world = sum over data-parallel
        # ranks (distinct tokens) and pipeline stages (distinct layers); TP is 1 (validated by arguments)
        self.popularity = ExpertPopularity(PopularityConfig(moe_layers=list(range(args.model.num_layers)),
                                                            num_experts=args.model.num_experts), all_reduce)
        if attach_popularity(state.model, self.popularity) == 0:
            raise RuntimeError("no PopularityRouter in the model: the layer spec was built without FTConfig "
                               "(pass the FT flags through pretrain_gpt_moe.extra_argument_groups)")
        if self.config.ft_capacity_boost:
            from moe_ft.recovery.boost import build_capacity_boost

            self.config.check_args(args)
            self.boost = build_capacity_boost(self.config.ft_capacity_boost, state, self.popularity)
        self.start_iteration = start_iteration
        self._setup_faults()
        if self.config.ft_policy != "none":
            from moe_ft.recovery.driver import should_recover

            recover, restart_count = should_recover(self.config, args)  # collective: every rank decides alike
            if recover:
                start_iteration = self._recover(state, data, args, start_iteration, restart_count)
        return start_iteration

    # ------------------------------------------------------------------------ faults and recovery
    def _setup_faults(self) -> None:
        from pathlib import Path

        from moe_ft.faults import FaultPlan, FaultPlanConfig

        job_dir = Path(self.config.ft_store_dir) / self.config.ft_job_id
        self.faults = FaultPlan.from_config(FaultPlanConfig(faults=list(self.config.ft_fail),
                                                            marker_dir=str(job_dir / "faults")))
        self._progress = job_dir / f"progress_rank{self.rank}"
        job_dir.mkdir(parents=True, exist_ok=True)  # --ft-policy none builds no store that would create it
        if self.config.ft_hang_timeout > 0:
            from moe_ft.recovery.watchdog import Watchdog

            self.watchdog = Watchdog(self.config.ft_hang_timeout, self.rank)

    def check_fault(self, iteration: int, phase: str) -> None:
        """Failure drill: fire the fault scheduled at (this rank, ``iteration``, ``phase``), once."""
        if self.faults:
            self.faults.check(self.rank, iteration, phase)

    def _in_recovery(self, iteration: int) -> bool:
        return self.report is not None and iteration <= self.report.failed["last_completed"]

    def _recover(self, state, data, args, start_iteration: int, restart_count: int) -> int:
        from dataclasses import replace

        from megatron.training.training import train_step
        from moe_ft.recovery.driver import recover, report_dir

        def step_fn(iteration, optimizer):
            return train_step(replace(state, optimizer=optimizer), data, iteration, args)

        self.report = recover(self, state, args, start_iteration, step_fn, restart_count)
        if self.boost is not None:
            from moe_ft.recovery.boost import start_after_recovery

            self.report.capacity_boost = start_after_recovery(self.boost, self.report, self.active.store)
        self._recovered_at = time.perf_counter()
        self._write_report(final=not self.report.reexecuted_iterations)
        return self.report.recovery_point["resume"]

    def _write_report(self, final: bool) -> None:
        from moe_ft.recovery.driver import report_dir

        if self.rank != 0:
            return
        if final:
            print(self.report.summary(), flush=True)
        self.report.write(report_dir(self.config))

    def _build(self) -> None:
        from moe_ft.state.catalogue import gather_catalogue
        from moe_ft.state.registry import OperatorRegistry

        self.registry = OperatorRegistry.from_megatron(self.state.model, self.state.optimizer)
        self.catalogue = gather_catalogue(self.registry.infos(), self.registry.ep_size)
        self.sessions = [self.build_session(self.config)]
        self.active = self.sessions[0]
        self._build_replication()

    def _build_replication(self) -> None:
        """Peer replicas and the durable tier of the active session's store (issue 5; collective)."""
        from moe_ft.replication.service import Layout, Replication, build_persistence
        from moe_ft.store import DenseRule

        c, store = self.config, self.active.store
        if store is None:
            return
        layout = Layout.gather(ranks_per_node=c.ft_ranks_per_node,
                               distributed_optimizer=self.args.parallel.use_distributed_optimizer)
        self.replication = Replication.build(num_replicas=c.ft_replicas, layout=layout, store=store,
                                             store_root=c.ft_store_dir, job_id=c.ft_job_id)
        retention = store.retention
        rule = (getattr(retention, "rule", None) or getattr(retention, "floor", None)
                or DenseRule(operators=frozenset(self.registry)))
        self.persistence = build_persistence(interval=c.ft_persist_interval,
                                             persist_dir=c.ft_persist_dir or self.args.training.save or "",
                                             store=store, rule=rule, rank=self.rank,
                                             world_size=dist.get_world_size(), job_id=c.ft_job_id)
        if self.persistence is not None and c.ft_policy == "dense":  # plain-Megatron-loadable dense points
            from moe_ft.persist.megatron_dense import MegatronDenseWriter

            self.megatron_dense = MegatronDenseWriter(self.persistence.config.persist_dir, self.state)

    def build_session(self, config: FTConfig, job_suffix: str = "") -> FTSession:
        """Policy + store + engine for ``config`` (collective-free; every rank builds the same policy)."""
        from moe_ft.policy import build_policy
        from moe_ft.snapshot import EngineConfig, SnapshotEngine
        from moe_ft.store import StoreConfig, retention_for_policy

        if config.ft_policy == "none":
            return FTSession("none", None, None, None)
        t_iter = self._first_iter_s or 1.0
        policy = build_policy(config.ft_policy, config.policy_config(t_iter), self.catalogue)
        policy.plan(self.start_iteration, self.popularity)  # opens the first window (sparse)
        window = getattr(policy, "window_length", None)
        retention = retention_for_policy(config.ft_policy, list(self.registry), window_size=window,
                                         window_offset=self.start_iteration % window if window else 0)
        rule = getattr(retention, "rule", None) or getattr(retention, "floor", None)
        if rule is not None:  # dense / sparse / pec / selective: keep a point common to all ranks
            from moe_ft.recovery.retention import KeepTwoRecoverable

            retention = KeepTwoRecoverable(rule=rule)
        store = StoreConfig(root=config.ft_store_dir, job_id=config.ft_job_id + job_suffix,
                            rank=self.rank).build(retention=retention, fault_hook=self._store_fault_hook)
        engine = SnapshotEngine(EngineConfig(num_slots=config.ft_snapshot_slots), self.registry, store)
        return FTSession(config.ft_policy, policy, engine, store)

    # ---------------------------------------------------------------------------------- iteration
    def on_step_begin(self, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(iteration)
        self.check_fault(iteration, "recovery" if self._in_recovery(iteration) else "forward")
        now = time.perf_counter()
        if self._step_start is not None:
            self.iteration_seconds[iteration - 1] = now - self._step_start
        self._step_start = now

    def before_optimizer_step(self, iteration: int) -> None:
        if not self._in_recovery(iteration):
            self.check_fault(iteration, "backward")
        for session in self.sessions:
            if session.engine is not None:
                session.engine.wait_copied()

    def on_step_end(self, iteration: int, result) -> None:
        from moe_ft.snapshot.meta import capture_step_meta

        if not self._in_recovery(iteration):
            self.check_fault(iteration, "step")
        self.popularity.end_iteration(iteration)
        if self.boost is not None:
            self._boost_end_iteration(iteration)
        if self.registry is None:
            self._first_iter_s = result.seconds
            self._build()
        session = self.select_session(iteration)
        if session.policy is None:
            session.last_plan = {}
            if self.config.ft_trace_out and self.rank == 0:  # popularity measured without snapshots
                self._trace(iteration, {})
        else:
            plan = session.policy.plan(iteration, self.popularity)
            session.last_plan = plan
            t = self.args.training
            meta, tensors = capture_step_meta(iteration=iteration, result=result, state=self.state,
                                              global_batch_size=t.global_batch_size, clip_grad=t.clip_grad,
                                              policy=session.policy, popularity=self.popularity)
            meta["policy_name"] = session.name
            if self.boost is not None:
                from moe_ft.recovery.boost import snapshot_tensors

                tensors.update(snapshot_tensors(self.boost))
            self.on_snapshot(iteration, plan)
            session.engine.submit(iteration, plan, meta, tensors)
            if not self._in_recovery(iteration):
                self.check_fault(iteration, "snapshot")  # the copy is in flight on the engine's thread
            self.popularity.mark_full(iteration, [op for op, lvl in plan.items() if lvl == Level.FULL])
            if self.replication is not None:
                self.replication.submit(iteration)  # enqueue only: the copies run on their own threads
            if self.persistence is not None:
                persist_plan = getattr(session.policy, "persist_plan", None)  # pec: K_persist experts (MoC §5.1)
                due = persist_plan is not None and self.persistence.due(iteration)
                self.persistence.submit(iteration, persist_plan(iteration, plan) if due else None)
            if self.megatron_dense is not None:
                dense = bool(plan) and all(lvl == Level.FULL for lvl in plan.values())
                if dense and self.persistence.due(iteration) and not self._in_recovery(iteration):
                    self.megatron_dense.save(iteration + 1)  # collective; the write runs in the background
                self.megatron_dense.poll()
            if self.config.ft_trace_out and self.rank == 0:
                self._trace(iteration, plan)
        self._log(iteration, session)
        self._after_iteration(iteration)

    def _after_iteration(self, iteration: int) -> None:
        from moe_ft.recovery.driver import write_progress

        if self._progress is not None:
            write_progress(self._progress, iteration)
        if self.persistence is not None and self.rank == 0:  # outlives every node (one small file, rank 0)
            write_progress(self.persistence.tier.directory / "progress", iteration)
        if self.report is not None and iteration == self.report.failed["last_completed"]:
            self.report.seconds["reexecute"] = round(time.perf_counter() - self._recovered_at, 4)
            self._write_report(final=True)

    def during_checkpoint_write(self, iteration: int) -> None:
        """The ``--save`` checkpoint after ``iteration`` iterations has its shards on disk but is not
        finalized: a ``persist`` fault of the iteration that ended there fires now (a torn checkpoint)."""
        if not self._in_recovery(iteration - 1):
            self.check_fault(iteration - 1, "persist")

    def _boost_end_iteration(self, iteration: int) -> None:
        """Pay the boosted experts' extra tokens off (collective while a boost is active); note in the
        recovery report when each expert made its lost tokens up."""
        from moe_ft.recovery.boost import record_made_up

        made_up = self.boost.end_iteration(iteration)
        section = self.report.capacity_boost if self.report is not None else None
        if made_up and section and record_made_up(section, made_up, iteration, self.boost.active):
            if self.rank == 0 and section.get("ended_at") is not None:
                print(f"moe-ft capacity boost: {len(section['experts'])} experts made up "
                      f"{section['tokens_to_make_up']:.0f} lost tokens by iteration {iteration}", flush=True)
            if not self._in_recovery(iteration):  # while re-executing, the final report write follows
                self._write_report(final=False)

    def _trace(self, iteration: int, plan) -> None:
        """One ``--ft-trace-out`` line (the popularity counters of ``iteration`` and its FULL experts)."""
        import json

        full = sorted([op.layer, op.expert] for op, lvl in plan.items() if lvl == Level.FULL and op.is_expert)
        line = {"iteration": iteration, "replay": self._in_recovery(iteration),
                "counts": self.popularity.last_counts.tolist(), "full_experts": full}
        if self.boost is not None:
            line["boost_deficit"] = self.boost.deficit.tolist()
        with open(self.config.ft_trace_out, "a") as f:
            f.write(json.dumps(line) + "\n")

    def select_session(self, iteration: int) -> FTSession:
        """The session that snapshots ``iteration`` (one here; the benchmark alternates)."""
        return self.active

    def on_snapshot(self, iteration: int, plan) -> None:
        """Called on the training thread right before the engine starts copying (tests capture here)."""

    def _store_fault_hook(self, phase: str, iteration: int, name: str) -> None:
        if phase == "before_commit" and not self._in_recovery(iteration):
            self.check_fault(iteration, "publish")  # everything written, the rename not yet done
        if phase == "after_commit" and self.faults and not self._in_recovery(iteration):
            points_dir = self.active.store.backend.points_dir  # the point just renamed into place
            self.faults.check(self.rank, iteration, "published", target=points_dir / f"{iteration:012d}")

    def on_train_end(self, report) -> None:
        if self._step_start is not None:
            self.iteration_seconds[report.last_iteration - 1] = time.perf_counter() - self._step_start
        for session in self.sessions:
            session.close()
        if self.replication is not None:
            self.replication.close()
        if self.persistence is not None:
            self.persistence.close()
        if self.megatron_dense is not None:
            self.megatron_dense.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.config.ft_digest_out:
            from moe_ft.cli.digest import write_digest

            write_digest(self.config.ft_digest_out, self.state, report.last_iteration)

    # ------------------------------------------------------------------------------------ metrics
    def metrics(self, session: FTSession) -> dict:
        rec = session.engine.records[-1] if session.engine is not None and session.engine.records else None
        prev = session.engine.records[-2] if session.engine is not None and len(session.engine.records) > 1 else None
        out = {"policy": session.name, "tokens_at_risk": float(self.popularity.since_full.sum())}
        if rec is not None:
            out.update(bytes=rec.bytes, full=rec.num_full, compute=rec.num_compute,
                       stall_ms=1e3 * (prev.stall_s if prev else 0.0))
        if self.replication is not None and rec is not None:
            out.update(self.replication.metrics(rec.iteration))
        if self.persistence is not None and self.persistence.records:
            p, ends = self.persistence.records[-1], self.persistence.tier.complete_points()
            if ends:  # the newest point every rank finished, not this rank's newest flush
                out.update(persist_end=ends[-1], persist_mb_s=p.nbytes / 1e6 / max(p.seconds, 1e-9))
        if self.boost is not None and self.boost.active:
            out.update(boost_experts=int((self.boost.deficit > 0).sum()), boost_deficit=float(self.boost.deficit.sum()))
        win = getattr(session.policy, "window_of", None)
        if win is not None and rec is not None:
            w = win(rec.iteration)
            out["window"] = f"{rec.iteration - w.start + 1}/{w.length}"
        return out

    def _log(self, iteration: int, session: FTSession) -> None:
        interval = self.config.ft_log_interval or self.args.training.log_interval
        if self.rank != 0 or (iteration + 1) % interval:
            return
        m = self.metrics(session)
        parts = [f"ft iteration {iteration + 1:6d}", f"policy {m['policy']}"]
        if "bytes" in m:
            parts += [f"snapshot {m['bytes'] / 1e6:.3f} MB (FULL {m['full']}, COMPUTE {m['compute']})",
                      f"stall {m['stall_ms']:.2f} ms"]
        if "window" in m:
            parts.append(f"window {m['window']}")
        if "replication_lag" in m:
            parts.append(f"replica {m['replication_bytes'] / 1e6:.3f} MB lag {m['replication_lag']} it")
        if "persist_end" in m:
            parts.append(f"durable {m['persist_end'] + 1} ({m['persist_mb_s']:.1f} MB/s)")
        if "boost_experts" in m:
            parts.append(f"capacity boost {m['boost_experts']} experts, {m['boost_deficit']:.0f} tokens to make up")
        parts.append(f"tokens at risk {m['tokens_at_risk']:.0f}")
        print(" | ".join(parts), flush=True)


def build_runtime(args) -> FTRuntime | None:
    """The runtime for parsed ``args`` (``None`` when ``--ft`` is off)."""
    config = args.extra.get("FTConfig")
    if config is None or not config.ft:
        return None
    return FTRuntime(config)
