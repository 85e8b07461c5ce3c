"""``FTConfig``: the fault-tolerance flags of ``pretrain_gpt_moe.py``, one nested config per component.

Fault tolerance is off unless ``--ft`` is given: plain Megatron behaviour by default. Once on, the
snapshot policy defaults to ``sparse`` (sparse is exact and is the default).

Each component owns its config dataclass, with its own validation and a ``build(...)`` that returns the
built component (``None`` when switched off), in its package: ``moe_ft/snapshot/config.py``,
``replication/config.py``, ``persist/config.py`` (the durable tier), ``drills/config.py``,
``recovery/config.py``, ``checkfree/config.py``; this module composes them. The
flags stay one per field: a nested config's fields become ``--<flag_prefix><field>`` (e.g.
``persist.interval`` is ``--ft-persist-interval``; ``megatron/training/argument_utils.py``). Cross-component
rules live in :meth:`FTConfig.__post_init__`; everything a snapshot policy means is asked of the policy
class (``moe_ft.policy.policy_class``), never decided by comparing its name here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron.training.argument_utils import dataclass_from_flags, field_help, non_negative
from megatron.training.extensions import LoopExtension
from moe_ft.checkfree.config import CheckFreeConfig
from moe_ft.drills.config import DrillConfig
from moe_ft.persist.config import DurableConfig
from moe_ft.policy.factory import POLICIES
from moe_ft.recovery.config import RecoverConfig
from moe_ft.replication.config import ReplicationConfig
from moe_ft.snapshot.config import SnapshotConfig


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
        non_negative(self, ("ft_log_interval",), "")
        self.checkfree.check(self.ft)
        cls = self.snapshot.policy_cls
        if cls is not None:
            cls.check_flags(self)
        self.replication.check_policy(cls)
        if self.snapshot.checksum_by == "agent" and self.persist.interval and not self.persist.agent:
            raise ValueError("--ft-checksum-by agent leaves the digests to the node agent, which records them after "
                             "publish; the durable copies must be made after that, by the agent too: add "
                             "--ft-persist-agent")
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
        """Checks against the model's flags (``args``: Megatron's parsed ``Args``); each component checks its
        own flags (``check_args`` of its config)."""
        self.checkfree.check_args(args)
        if self.ft:  # without --ft no component is built: its flags have nothing to refuse
            self.snapshot.check_args(args)
            self.replication.check_args(args)
            self.recovery.check_args(args)
            if self.snapshot.enabled:  # the durable tier copies snapshots: --ft-policy none builds none
                self.persist.check_args(args)
        if (self.ft and getattr(args.model, "moe_grouped_gemm", False)
                and getattr(args.parallel, "use_distributed_optimizer", False)):
            raise ValueError("--ft with --moe-grouped-gemm and --use-distributed-optimizer: an expert's state would be "
                             "slices of a flat optimizer shard, which the snapshots do not capture; drop "
                             "--moe-grouped-gemm (SequentialMLP experts) or --use-distributed-optimizer")
        cls = self.snapshot.policy_cls
        if (self.ft and getattr(args.model, "moe_grouped_gemm", False)
                and getattr(args.model, "transformer_impl", "local") == "local" and not cls.lossy
                and not cls.dense_points):
            raise ValueError(f"--ft-policy {self.snapshot.policy} replays a window with some experts frozen "
                             "(MoEvement §3.3), but GroupedMLP (--moe-grouped-gemm with --transformer-impl local) "
                             "keeps a layer's local experts in one weight with one Adam step counter: one expert "
                             "cannot stay frozen while another steps, and the replay would not be exact; drop "
                             "--moe-grouped-gemm (SequentialMLP), use --transformer-impl transformer_engine (a "
                             "weight per expert), or --ft-policy dense")
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
