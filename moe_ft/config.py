"""``FTConfig``: the fault-tolerance flags of ``pretrain_gpt_moe.py`` (one flag per field, ``--ft-*``).

Fault tolerance is off unless ``--ft`` is given: plain Megatron behaviour by default. Once on, the
snapshot policy defaults to ``sparse`` (SPEC §3: "sparse is exact and is the default").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.training.argument_utils import field_help

POLICY_CHOICES = ["none", "dense", "pec", "selective", "sparse"]


@dataclass(kw_only=True)
class FTConfig:
    ft: bool = field(default=False, metadata=field_help("Enable the moe-ft runtime (per-iteration snapshots)."))
    ft_policy: str = field(default="sparse", metadata=field_help(
        "Snapshot policy (SPEC §3); 'none' counts popularity and logs but snapshots nothing.", choices=POLICY_CHOICES))
    ft_store_dir: str = field(default="/dev/shm/moe_ft", metadata=field_help(
        "Root of the node-local snapshot store (a tmpfs, so snapshots outlive the worker)."))
    ft_job_id: str = field(default="default", metadata=field_help("Job name inside --ft-store-dir."))
    ft_dense_interval: int = field(default=1, metadata=field_help("dense: snapshot every N iterations."))
    ft_pec_k: int = field(default=1, metadata=field_help("pec: K_snapshot experts per layer per checkpoint."))
    ft_pec_selection: str = field(default="sequential", metadata=field_help(
        "pec: expert selection.", choices=["sequential", "load_aware"]))
    ft_sparse_window: int = field(default=0, metadata=field_help(
        "sparse: W_sparse in iterations; 0 = FindWindowSize (MoEvement Alg. 1) from --ft-snapshot-bandwidth "
        "and the measured time of the first iteration."))
    ft_sparse_order: str = field(default="popularity", metadata=field_help(
        "sparse: operator order (MoEvement §3.5, App. B).", choices=["popularity", "soft", "ema"]))
    ft_snapshot_bandwidth: float = field(default=25e9, metadata=field_help(
        "Device-to-host bytes/s of one rank (B_PCIe; sparse window, selective local budget)."))
    ft_selective_local_budget: int = field(default=0, metadata=field_help(
        "selective: B_local bytes per iteration per rank; 0 = bandwidth x first iteration time."))
    ft_selective_remote_budget: int = field(default=0, metadata=field_help(
        "selective: B_remote bytes per iteration per rank; 0 = same as the local budget."))
    ft_snapshot_slots: int = field(default=2, metadata=field_help("Host buffer sets of the snapshot engine."))
    ft_log_interval: int = field(default=0, metadata=field_help(
        "Iterations between FT metric lines (0 = the training --log-interval)."))
    ft_recover: str = field(default="auto", metadata=field_help(
        "Recover from the node-local store at start: 'auto' = after a torchrun restart "
        "(TORCHELASTIC_RESTART_COUNT > 0), 'always', or 'never'.", choices=["auto", "always", "never"]))
    ft_fail: list[str] = field(default_factory=list, metadata=field_help(
        "Failure drill: inject faults RANK:ITER[:PHASE[:KIND]] (PHASE forward|backward|step|snapshot|publish|"
        "persist|recovery|published, KIND exit|exception|hang|corrupt); each fires once across restarts "
        "(moe_ft/faults.py)."))
    ft_hang_timeout: float = field(default=0.0, metadata=field_help(
        "Seconds without iteration progress after which a rank declares itself hung and exits so torchrun "
        "restarts the job (0 = no watchdog)."))
    ft_digest_out: str = field(default="", metadata=field_help(
        "Write the final training-state digest (moe-ft digest) as JSON to this file at the end of training."))
    ft_trace_out: str = field(default="", metadata=field_help(
        "Rank 0 appends one JSON line per trained iteration (not replays) to this file: the world-summed "
        "per-expert token counts and the experts the plan saved FULL (drills recompute PLT/MLT from it)."))
    ft_report_dir: str = field(default="", metadata=field_help(
        "Directory for recovery reports (JSON); empty = <ft-store-dir>/<ft-job-id>/reports."))
    ft_replicas: int = field(default=2, metadata=field_help(
        "Peers on other nodes holding a copy of each rank's snapshots (MoEtion Alg. 2; 0 = off). A job on one "
        "node has no other failure domain and does not replicate."))
    ft_ranks_per_node: int = field(default=0, metadata=field_help(
        "Ranks per node for replica placement (0 = LOCAL_WORLD_SIZE); smaller values simulate nodes."))
    ft_persist_interval: int = field(default=0, metadata=field_help(
        "Copy the newest recovery point to durable storage every N iterations in the background (0 = off)."))
    ft_persist_dir: str = field(default="", metadata=field_help(
        "Durable tier root (<dir>/moe_ft/<job>); empty = --save."))
    ft_capacity_boost: float = field(default=0.0, metadata=field_help(
        "MoEtion §6 capacity boost: after a pec/selective recovery, every expert restored from a stale FULL "
        "entry gets this fraction more capacity (0.1 = 10 %%) until it has kept as many extra tokens as the "
        "recovery lost for it (0 = off). Needs token dropping (--moe-expert-capacity-factor)."))

    def __post_init__(self) -> None:
        if self.ft_policy not in POLICY_CHOICES:
            raise ValueError(f"--ft-policy must be one of {POLICY_CHOICES}, got {self.ft_policy!r}")
        for name in ("ft_dense_interval", "ft_pec_k", "ft_snapshot_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("ft_sparse_window", "ft_selective_local_budget", "ft_selective_remote_budget", "ft_log_interval",
                     "ft_replicas", "ft_ranks_per_node", "ft_persist_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.ft_policy == "pec" and self.ft_persist_interval > 1:
            raise ValueError(f"--ft-persist-interval {self.ft_persist_interval} with --ft-policy pec: pec persists "
                             "K_persist experts of every snapshot (MoC §5.1), so a durable point would never "
                             "hold every expert's FULL state (the sequential expert cycle aliases with the "
                             "interval); use --ft-persist-interval 1 (or 0 = no durable tier)")
        if self.ft_hang_timeout < 0:
            raise ValueError("--ft-hang-timeout must be >= 0 seconds")
        from moe_ft.faults import Fault

        for text in self.ft_fail:
            Fault.parse(text)  # raises ValueError naming the bad fault
        if self.ft_snapshot_bandwidth <= 0:
            raise ValueError("--ft-snapshot-bandwidth must be positive (bytes/s)")
        if self.ft_capacity_boost < 0:
            raise ValueError(f"--ft-capacity-boost must be >= 0 (a fraction, 0.1 = 10 %), got {self.ft_capacity_boost}")
        if self.ft_capacity_boost and self.ft_policy not in ("pec", "selective"):
            raise ValueError(f"--ft-capacity-boost makes up the tokens a lossy recovery loses; --ft-policy "
                             f"{self.ft_policy} loses none: use it with --ft-policy pec or selective")

    def check_args(self, args) -> None:
        """Checks against the model's flags (``args``: Megatron's parsed ``Args``)."""
        if self.ft and self.ft_capacity_boost and getattr(args.model, "moe_expert_capacity_factor", None) is None:
            raise ValueError("--ft-capacity-boost gives stale experts more *capacity*: it needs token dropping, "
                             "set --moe-expert-capacity-factor (e.g. 1.0); without it no expert drops tokens "
                             "and there is nothing to boost")

    def customize_layer_spec(self, spec):
        """Install the popularity-counting router (``moe_ft.megatron_ext.router``) when FT is on."""
        if not self.ft:
            return spec
        from moe_ft.megatron_ext.router import install_router

        return install_router(spec)

    def policy_config(self, t_iter_s: float) -> dict:
        """The policy's config fields from the flags; ``t_iter_s``: measured iteration time."""
        if self.ft_policy == "dense":
            return {"interval": self.ft_dense_interval}
        if self.ft_policy == "pec":
            return {"k_snapshot": self.ft_pec_k, "k_persist": 1, "selection": self.ft_pec_selection}
        if self.ft_policy == "selective":
            local = self.ft_selective_local_budget or int(self.ft_snapshot_bandwidth * t_iter_s)
            return {"local_budget": local, "remote_budget": self.ft_selective_remote_budget or local}
        if self.ft_policy == "sparse":
            if self.ft_sparse_window:
                return {"window": self.ft_sparse_window, "order": self.ft_sparse_order}
            return {"window": "auto", "bandwidth_bytes_per_s": self.ft_snapshot_bandwidth, "t_iter_s": t_iter_s,
                    "order": self.ft_sparse_order}
        return {}

    @property
    def needs_popularity(self) -> bool:
        """Whether the popularity counters must be summed over all ranks: the policy reads them (sparse,
        selective, pec load-aware), or a lossy recovery accounts the tokens lost per expert (pec,
        selective: PLT/MLT and the capacity boost need the whole job's tokens, not one rank's), or the
        ``--ft-trace-out`` file records them (its counts are the job's, whatever the policy)."""
        return self.ft_policy in ("sparse", "selective", "pec") or bool(self.ft_trace_out)
