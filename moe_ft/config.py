"""``FTConfig``: the fault-tolerance flags of ``pretrain_gpt_moe.py``, one nested config per component.

Fault tolerance is off unless ``--ft`` is given: plain Megatron behaviour by default. Once on, the
snapshot policy defaults to ``sparse`` (sparse is exact and is the default).

Each component (snapshot, replication, durable tier, drills, recovery) has its own config dataclass with
its own validation and a ``build(...)`` that returns the built component (``None`` when switched off). The
flags stay one per field: a nested config's fields become ``--<flag_prefix><field>`` (e.g.
``persist.interval`` is ``--ft-persist-interval``; ``megatron/training/argument_utils.py``). Cross-component
rules live in :meth:`FTConfig.__post_init__`; everything a snapshot policy means is asked of the policy
class (``moe_ft.policy.policy_class``), never decided by comparing its name here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.training.argument_utils import dataclass_from_flags, field_help
from megatron.training.extensions import LoopExtension
from moe_ft.checkfree.config import CheckFreeConfig
from moe_ft.drills.faults import Fault, FaultPlan, FaultPlanConfig
from moe_ft.policy.factory import NO_SNAPSHOTS, POLICIES, POLICY_CHOICES, policy_class
from moe_ft.precision.config import check_exact_recovery
from moe_ft.snapshot.session import build_session

if TYPE_CHECKING:
    from moe_ft.runtime.context import BuildContext


def _non_negative(obj, names: tuple[str, ...], prefix: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"--{(prefix + name).replace('_', '-')} must be >= 0, got {getattr(obj, name)}")


@dataclass(kw_only=True)
class SnapshotConfig:
    """The snapshot policy, the node-local store and the snapshot engine."""

    policy: str = field(default="sparse", metadata=field_help(
        "Snapshot policy; 'none' counts popularity and logs but snapshots nothing.", choices=POLICY_CHOICES))
    store_dir: str = field(default="/dev/shm/moe_ft", metadata=field_help(
        "Root of the node-local snapshot store (a tmpfs, so snapshots outlive the worker)."))
    job_id: str = field(default="default", metadata=field_help("Job name inside --ft-store-dir."))
    dense_interval: int = field(default=1, metadata=field_help("dense: snapshot every N iterations."))
    pec_k: int = field(default=1, metadata=field_help("pec: K_snapshot experts per layer per checkpoint."))
    pec_k_persist: int = field(default=1, metadata=field_help(
        "pec: K_persist experts per layer of each checkpoint also written to the durable tier (MoC §5.1 "
        "two-level PEC); 1 <= K_persist <= --ft-pec-k."))
    pec_selection: str = field(default="sequential", metadata=field_help(
        "pec: expert selection.", choices=["sequential", "load_aware"]))
    sparse_window: int = field(default=0, metadata=field_help(
        "sparse: W_sparse in iterations; 0 = FindWindowSize (MoEvement Alg. 1) from --ft-snapshot-bandwidth "
        "and the measured time of the first iteration."))
    sparse_order: str = field(default="popularity", metadata=field_help(
        "sparse: operator order (MoEvement §3.5, App. B).", choices=["popularity", "soft", "ema"]))
    snapshot_bandwidth: float = field(default=25e9, metadata=field_help(
        "Device-to-host bytes/s of one rank (B_PCIe; sparse window, selective local budget)."))
    selective_local_budget: int = field(default=0, metadata=field_help(
        "selective: B_local bytes per iteration per rank; 0 = bandwidth x first iteration time."))
    selective_remote_budget: int = field(default=0, metadata=field_help(
        "selective: B_remote bytes per iteration per rank; 0 = same as the local budget."))
    snapshot_slots: int = field(default=2, metadata=field_help("Host buffer sets of the snapshot engine."))
    snapshot_bubble_aware: bool = field(default=False, metadata=field_help(
        "Bubble-aware snapshots (MoEtion §5.3, Alg. 4; CPU engine, pipeline parallelism): the part of each "
        "copy that fits the profiled pipeline bubbles waits for the stage to idle in a p2p exchange."))
    snapshot_direct_write: bool = field(default=True, metadata=field_help(
        "One copy per snapshot byte. CPU: write the live tensors straight into the store (the next optimizer "
        "step waits until they are written) instead of copying them into slot buffers first. GPU with the "
        "arena layout: the device-to-host copy lands in the store's page-locked regions and the checksum is "
        "computed on the device (mfh64), so the trainer's host threads touch no payload byte; off: pinned "
        "slot buffers, then a host checksum and store write. Bubble-aware snapshots always use buffers."))
    store_layout: str = field(default="arena", metadata=field_help(
        "Node-local store layout: 'arena' (each rank's points in regions of a few preallocated files on the "
        "tmpfs, reused point after point; publishing writes one index file) or 'files' (a directory of "
        "entry files per point). A store directory that exists is read as what it holds.",
        choices=["arena", "files"]))
    store_recycle: bool = field(default=True, metadata=field_help(
        "'files' layout: write new entries over the files of deleted points of the same size (tmpfs pages "
        "reused instead of freed and allocated again; the pool holds at most one round of deleted points)."))
    snapshot_write_threads: int = field(default=0, metadata=field_help(
        "Threads writing one snapshot's entries into the store (0 = 1 on CPU, 4 on CUDA: one thread writes "
        "~1.3 GB/s on an H100 host, far below the device-to-host copy)."))

    def __post_init__(self) -> None:
        policy_class(self.policy)  # raises ValueError naming the choices
        for name in ("dense_interval", "pec_k", "snapshot_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"--ft-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        _non_negative(self, ("sparse_window", "selective_local_budget", "selective_remote_budget",
                             "snapshot_write_threads"), "ft_")
        if not 1 <= self.pec_k_persist <= self.pec_k:
            raise ValueError(f"--ft-pec-k-persist must be in [1, --ft-pec-k={self.pec_k}] (MoC §5.1: the durable "
                             f"tier holds a subset of each checkpoint's experts), got {self.pec_k_persist}")
        if self.snapshot_bandwidth <= 0:
            raise ValueError("--ft-snapshot-bandwidth must be positive (bytes/s)")

    @property
    def policy_cls(self):
        """The policy class (``None`` for ``--ft-policy none``)."""
        return policy_class(self.policy)

    @property
    def enabled(self) -> bool:
        return self.policy != NO_SNAPSHOTS

    def build(self, ctx: "BuildContext", *, job_suffix: str = ""):
        """Policy + store + engine (collective-free; every rank builds the same policy), or ``None`` for
        ``--ft-policy none``. See :func:`moe_ft.snapshot.session.build_session`."""
        if not self.enabled:
            return None

        return build_session(self, ctx, job_suffix=job_suffix)


@dataclass(kw_only=True)
class ReplicationConfig:
    """Peer replicas of every snapshot (MoEtion Alg. 2, §5.1)."""

    replicas: int = field(default=2, metadata=field_help(
        "Peers on other nodes holding a copy of each rank's snapshots (MoEtion Alg. 2; 0 = off). A job on one "
        "node has no other failure domain and does not replicate."))
    ranks_per_node: int = field(default=0, metadata=field_help(
        "Ranks per node for replica placement (0 = LOCAL_WORLD_SIZE); smaller values simulate nodes."))
    replication_bandwidth: float = field(default=0.0, metadata=field_help(
        "Network bytes/s one rank may spend on replicas: B_remote = this x the measured iteration time "
        "(MoEtion §4.2); the newest recovery point goes first, older ones are skipped (0 = unlimited)."))
    optimizer_recompute: bool = field(default=False, metadata=field_help(
        "Asynchronous optimizer recomputation (MoEtion §5.2, Alg. 3): an expert FULL in consecutive points is "
        "sent to the peers as the gradients of its step, and each peer replays the optimizer update to keep "
        "its FULL state (fp32/bf16 torch Adam, no distributed optimizer); needs --ft-replicas and "
        "--ft-policy selective."))
    optimizer_recompute_local: str = field(default="full", metadata=field_help(
        "What the owner snapshots of an expert sent as gradients (--ft-optimizer-recompute): 'full' writes its "
        "FULL state locally as well (a local restart needs no peer); 'compute' writes only its compute "
        "weights and a checksum of the FULL state, which the peers rebuild (MoEtion §5.2: 2/3 fewer local "
        "bytes for such experts in fp32). A restart then fetches those FULL entries from the peers; without "
        "them recovery falls back to the newest point this node holds whole.",
        choices=("full", "compute")))

    def __post_init__(self) -> None:
        _non_negative(self, ("replicas", "ranks_per_node", "replication_bandwidth"), "ft_")
        if self.optimizer_recompute and not self.replicas:
            raise ValueError("--ft-optimizer-recompute recomputes optimizer steps on replica peers; it needs "
                             "--ft-replicas >= 1")
        if self.optimizer_recompute_local not in ("full", "compute"):
            raise ValueError(f"--ft-optimizer-recompute-local must be 'full' or 'compute', got "
                             f"{self.optimizer_recompute_local!r}")
        if self.optimizer_recompute_local == "compute" and not self.optimizer_recompute:
            raise ValueError("--ft-optimizer-recompute-local compute leaves FULL states to the peers' optimizer "
                             "recomputation; add --ft-optimizer-recompute")
        if self.optimizer_recompute_local == "compute" and self.replication_bandwidth:
            raise ValueError("--ft-optimizer-recompute-local compute needs every point sent in order (the owner "
                             "keeps only compute weights of experts the next message carries as gradients); "
                             "--ft-replication-bandwidth may skip points: drop one of the two flags")

    def check_policy(self, policy_cls) -> None:
        """Cross-check with the snapshot policy (``FTConfig.__post_init__``)."""
        if self.optimizer_recompute and not getattr(policy_cls, "recomputes_optimizer_on_peer", False):
            name = getattr(policy_cls, "name", "none") or "none"
            raise ValueError(f"--ft-optimizer-recompute exploits the stable periods of selective expert "
                             f"checkpointing (MoEtion §5.2); --ft-policy {name} has none: use --ft-policy "
                             "selective or drop --ft-optimizer-recompute")

    def build(self, ctx: "BuildContext", session):
        """The replication service of ``session``'s store (collective), or ``None`` (no store, r = 0, or a
        single-node job)."""
        if session is None:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.replication.service import Layout, Replication

        layout = Layout.gather(ranks_per_node=self.ranks_per_node,
                               distributed_optimizer=ctx.args.parallel.use_distributed_optimizer)
        return Replication.build(num_replicas=self.replicas, layout=layout, store=session.store,
                                 store_root=session.store_root, job_id=session.job_id,
                                 remote_budget=self.remote_budget(ctx), recompute=self.recompute(ctx),
                                 compute_only=self.optimizer_recompute_local == "compute")

    def recompute(self, ctx: "BuildContext"):
        """The gradient capture of ``--ft-optimizer-recompute`` as a factory (built only when replicating),
        or ``None``."""
        if not self.optimizer_recompute:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.replication.optim_recompute import GradCapture

        return lambda: GradCapture.from_megatron(ctx.registry, ctx.state.optimizer)

    def remote_budget(self, ctx: "BuildContext"):
        """``B_remote`` as a callable the sender asks before each point: ``--ft-replication-bandwidth`` x the
        iteration time agreed now (the runtime's clock, else the build-time measurement), MoEtion §4.2;
        ``None`` (unlimited) without the flag."""
        if not self.replication_bandwidth:
            return None
        clock = ctx.clock

        def budget() -> int:
            t_iter_s = (clock.t_iter_s if clock is not None else None) or ctx.t_iter_s
            return int(self.replication_bandwidth * t_iter_s)

        return budget


@dataclass(kw_only=True)
class DurableConfig:
    """The durable tier: background copies of recovery points to shared storage (MoC §5.1 two-level)."""

    interval: int = field(default=0, metadata=field_help(
        "Copy the newest recovery point to durable storage every N iterations in the background (0 = off)."))
    dir: str = field(default="", metadata=field_help(
        "Durable tier root (<dir>/moe_ft/<job>); empty = --save."))
    agent: bool = field(default=False, metadata=field_help(
        "The node agent (one niced process per node, started by the first rank that needs it, outliving the "
        "workers) copies the points to the durable tier; the trainers only tell it which iteration."))
    agent_idle_exit: float = field(default=600.0, metadata=field_help(
        "The node agent exits after this many seconds without a connected trainer (the job died and did not "
        "come back); at a clean end it exits once every rank is done."))

    def __post_init__(self) -> None:
        _non_negative(self, ("interval",), "ft_persist_")

    def root(self, save_dir: str | None) -> str:
        return self.dir or save_dir or ""

    def build(self, ctx: "BuildContext", session):
        """The durable writer of ``session``'s store (plus Megatron-format copies when the policy's points
        are dense), or ``None``."""
        if session is None or not self.interval:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.runtime.components import Durable

        return Durable.build(self.interval, self.root(ctx.args.training.save), ctx, session, agent=self.agent,
                             agent_idle_exit_s=self.agent_idle_exit)


@dataclass(kw_only=True)
class DrillConfig:
    """Failure drills: injected faults and the files drills compare (``moe_ft/drills/faults.py``, ``moe-ft drill``)."""

    fail: list[str] = field(default_factory=list, metadata=field_help(
        "Failure drill: inject faults RANK:ITER[:PHASE[:KIND]] (PHASE forward|backward|step|snapshot|publish|"
        "persist|recovery|published, KIND exit|exception|hang|corrupt|node); each fires once across restarts "
        "(moe_ft/drills/faults.py)."))
    fail_marker_dir: str = field(default="", metadata=field_help(
        "Directory of the faults' once-only markers (default: faults/ in the node store's job directory). "
        "Drills on several simulated nodes share one: a rank that a spare on another node took over finds its "
        "fault fired."))
    digest_out: str = field(default="", metadata=field_help(
        "Write the final training-state digest (moe-ft digest) as JSON to this file at the end of training."))
    trace_out: str = field(default="", metadata=field_help(
        "Rank 0 appends one JSON line per trained iteration (not replays) to this file: the world-summed "
        "per-expert token counts and the experts the plan saved FULL (drills recompute PLT/MLT from it)."))

    def __post_init__(self) -> None:
        for text in self.fail:
            Fault.parse(text)  # raises ValueError naming the bad fault

    def build(self, job_dir: str):
        """The fault plan (fired markers under ``--ft-fail-marker-dir`` or ``job_dir/faults``: each fault fires
        once across restarts)."""

        marker_dir = self.fail_marker_dir or os.path.join(job_dir, "faults")
        return FaultPlan.from_config(FaultPlanConfig(faults=list(self.fail), marker_dir=marker_dir))


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
        "(sparse replay, own point, peer replica), 'durable' (+ durable point or --load checkpoint), 'lossy' "
        "(+ pec/selective, PLT/MLT), 'approximate' (+ CheckFree rebuild of a lost pipeline stage), 'none' "
        "(+ starting over). Levels per operator are in the recovery report (moe_ft/recovery/planner.py).",
        choices=["exact", "durable", "lossy", "approximate", "none"]))
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
        if self.min_recovery_level not in ("exact", "durable", "lossy", "approximate", "none"):
            raise ValueError(f"--ft-min-recovery-level must be exact, durable, lossy, approximate or none, got "
                             f"{self.min_recovery_level!r}")

    def build_watchdog(self, rank: int):
        if not self.hang_timeout:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.recovery.watchdog import Watchdog

        return Watchdog(self.hang_timeout, rank)

    def build_boost(self, state, popularity):
        """The MoEtion §6 capacity boost attached to the routers, or ``None``."""
        if not self.capacity_boost:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.recovery.boost import build_capacity_boost

        return build_capacity_boost(self.capacity_boost, state, popularity)

    def survivor_deadline_s(self) -> float:
        """``--ft-survivor-deadline``, or the launcher's grace between SIGTERM and SIGKILL minus 5 s (the
        dump must be published before the kill; at least 1 s)."""
        if self.survivor_deadline:
            return self.survivor_deadline
        grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        return max(1.0, grace - 5.0)


def _nested(cls, prefix: str, title: str):
    return field(default_factory=cls, metadata={"flag_prefix": prefix, "help": title})


@dataclass(kw_only=True)
class FTConfig(LoopExtension):
    """All fault-tolerance flags: ``--ft``, ``--ft-log-interval`` and one nested config per component."""

    ft: bool = field(default=False, metadata=field_help("Enable the moe-ft runtime (per-iteration snapshots)."))
    ft_log_interval: int = field(default=0, metadata=field_help(
        "Iterations between FT metric lines (0 = the training --log-interval)."))
    snapshot: SnapshotConfig = _nested(SnapshotConfig, "ft_", "snapshots")
    replication: ReplicationConfig = _nested(ReplicationConfig, "ft_", "replication")
    persist: DurableConfig = _nested(DurableConfig, "ft_persist_", "durable tier")
    drill: DrillConfig = _nested(DrillConfig, "ft_", "failure drills")
    recovery: RecoverConfig = _nested(RecoverConfig, "ft_", "recovery")
    checkfree: CheckFreeConfig = _nested(CheckFreeConfig, "ft_checkfree_", "CheckFree+ (moe_ft/checkfree/config.py)")

    def __post_init__(self) -> None:
        _non_negative(self, ("ft_log_interval",), "")
        self.checkfree.check(self.ft)
        cls = self.snapshot.policy_cls
        if cls is not None:
            cls.check_flags(self)
        self.replication.check_policy(cls)
        if self.replication.optimizer_recompute_local == "compute" and self.persist.interval:
            raise ValueError("--ft-optimizer-recompute-local compute leaves experts' FULL states to the replica "
                             "peers, and the durable tier copies this node's store (--ft-persist-interval): "
                             "use --ft-optimizer-recompute-local full with the durable tier")
        if self.recovery.capacity_boost and not (cls is not None and cls.lossy):
            lossy = " or ".join(name for name, (c, _) in sorted(POLICIES.items()) if c.lossy)
            raise ValueError(f"--ft-capacity-boost makes up the tokens a lossy recovery loses; --ft-policy "
                             f"{self.snapshot.policy} loses none: use it with --ft-policy {lossy}")

    @classmethod
    def from_flags(cls, **flags) -> "FTConfig":
        """The config the parser builds from these flags (dest names: ``ft_policy="pec"``,
        ``ft_persist_interval=1``); every other flag at its default."""
        return dataclass_from_flags(cls, **flags)

    def check_args(self, args) -> None:
        """Checks against the model's flags (``args``: Megatron's parsed ``Args``)."""
        self.checkfree.check_args(args)
        if self.ft:  # snapshots must restore this precision bit for bit

            check_exact_recovery(args)
        if (self.ft and getattr(args.model, "moe_grouped_gemm", False)
                and getattr(args.parallel, "use_distributed_optimizer", False)):
            raise ValueError("--ft with --moe-grouped-gemm and --use-distributed-optimizer: an expert's state would be "
                             "slices of a flat optimizer shard, which the snapshots do not capture; drop "
                             "--moe-grouped-gemm (SequentialMLP experts) or --use-distributed-optimizer")
        if self.ft and self.recovery.capacity_boost and getattr(args.model, "moe_expert_capacity_factor", None) is None:
            raise ValueError("--ft-capacity-boost gives stale experts more *capacity*: it needs token dropping, "
                             "set --moe-expert-capacity-factor (e.g. 1.0); without it no expert drops tokens "
                             "and there is nothing to boost")

    def customize_layer_spec(self, spec):
        """Install the popularity-counting router (``moe_ft.megatron_ext.router``) when FT is on."""
        if not self.ft:
            return spec

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.megatron_ext.router import install_router

        return self.checkfree.customize_layer_spec(install_router(spec))

    @property
    def needs_popularity(self) -> bool:
        """Whether the popularity counters must be summed over all ranks: the policy reads them, or a lossy
        recovery accounts the tokens lost per expert (PLT/MLT and the capacity boost need the whole job's
        tokens, not one rank's), or the ``--ft-trace-out`` file records them (its counts are the job's,
        whatever the policy)."""
        cls = self.snapshot.policy_cls
        return (cls is not None and (cls.reads_popularity or cls.lossy)) or bool(self.drill.trace_out)

    def report_dir(self) -> str:
        return self.recovery.report_dir or os.path.join(self.snapshot.store_dir, self.snapshot.job_id, "reports")

    def job_dir(self) -> str:
        return os.path.join(self.snapshot.store_dir, self.snapshot.job_id)
