"""The snapshot component's flags (``--ft-policy``, ``--ft-store-*``, ``--ft-snapshot-*``, ...) and its build:
the policy, the node-local store and the snapshot engine (``moe_ft/snapshot/session.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.training.argument_utils import field_help, non_negative
from moe_ft.policy.factory import NO_SNAPSHOTS, POLICY_CHOICES, policy_class
from moe_ft.snapshot.bubbles import check_pipeline
from moe_ft.snapshot.session import build_session

if TYPE_CHECKING:
    from moe_ft.replication.config import ReplicationConfig
    from moe_ft.runtime.context import BuildContext


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
    pec_fixed_k: bool = field(default=False, metadata=field_help(
        "pec: keep K at --ft-pec-k for the whole run; without it Dynamic-K (MoC §5.3) doubles K after recoveries "
        "whose PLT adds up past 3.75 %."))
    pec_selection: str = field(default="sequential", metadata=field_help(
        "pec: expert selection.", choices=["sequential", "load_aware"]))
    sparse_window: int = field(default=0, metadata=field_help(
        "sparse: W_sparse in iterations; 0 = FindWindowSize (MoEvement Alg. 1) from --ft-snapshot-bandwidth "
        "(bounded by --ft-replication-bandwidth / --ft-replicas when both are set) and the measured iteration "
        "time, found again when it changes."))
    sparse_order: str = field(default="popularity", metadata=field_help(
        "sparse: operator order (MoEvement §3.5, App. B).", choices=["popularity", "soft", "ema"]))
    snapshot_bandwidth: float = field(default=25e9, metadata=field_help(
        "Device-to-host bytes/s of one rank (B_PCIe; sparse window, selective budgets)."))
    selective_local_budget: int = field(default=0, metadata=field_help(
        "selective: B_local bytes per iteration per rank; 0 = bandwidth x first iteration time."))
    selective_remote_budget: int = field(default=0, metadata=field_help(
        "selective: B_remote bytes per iteration per rank; 0 = the local budget, or less where "
        "--ft-replication-bandwidth / --ft-replicas x the iteration time is less (with a derived local budget)."))
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
    checksum_by: str = field(default="writer", metadata=field_help(
        "Who hashes the snapshot entries: 'writer' (the trainer's snapshot threads, as they write) or 'agent' "
        "(the trainer writes each byte once; the node agent hashes each published point and records its "
        "digests beside it, and readers verify against those; a point it has not hashed yet is checked for "
        "its structure only). 'agent' needs the durable copies, if any, made by the agent too "
        "(--ft-persist-agent) and the replicas, if any, sent by the agents too (--ft-replicate-by agent: the agent "
        "hashes a point before it sends it).", choices=["writer", "agent"]))
    publish_by: str = field(default="trainer", metadata=field_help(
        "Who finishes each snapshot after the copy: 'trainer' (its snapshot thread writes each entry's header and "
        "digest, the manifest and the index, and collects garbage) or 'agent' (the trainer copies the tensors into "
        "its arena and hands the point to the node agent, which does the rest in its own process: no Python "
        "of the snapshot's left in the trainer to hold the GIL; needs the arena layout). The agent is started "
        "as for --ft-checksum-by agent (by moe-ft launch, or by a trainer under torchrun).",
        choices=["trainer", "agent"]))
    store_checksum: str = field(default="auto", metadata=field_help(
        "The snapshot entries' checksum: 'auto' (mfh64 on the arena layout: on CUDA computed on the device, "
        "on CPU by the copy into the arena when moe-ft's C extension is built, one host pass over each byte; "
        "else xxh3_64), or one by name (xxh3_64: hashed, then written, two host passes on CPU; on CUDA a "
        "name other than mfh64 copies through pinned slot buffers and hashes on the host).",
        choices=["auto", "mfh64", "xxh3_64", "crc32", "blake2b"]))
    snapshot_write_threads: int = field(default=0, metadata=field_help(
        "Threads writing one snapshot's entries into the store (0 = 1 on CPU, 4 on CUDA: one thread writes "
        "~1.3 GB/s on an H100 host, far below the device-to-host copy)."))

    snapshot_copy_piece_mb: int = field(default=0, metadata=field_help(
        "GPU snapshots into the arena: queue the device-to-host copy in pieces of at most this many MiB, each "
        "after the previous one ended, so that the training thread's own small reads from the device (the MoE "
        "dispatcher's token counts, the loss) wait for one piece instead of the whole snapshot (the copy "
        "engine takes transfers in order); 0 = the whole copy at once."))
    snapshot_copy_by: str = field(default="dma", metadata=field_help(
        "GPU snapshots into the arena: who copies the bytes to the host. 'dma': the copy engine (then a kernel "
        "hashes them on the device); 'kernel': the hash kernel stores every word it hashes into the arena "
        "through the device's mapping of the page-locked arena (one launch for copy and hash; the training "
        "thread's small reads from the device then find the copy engine idle; tensors of partial words still "
        "go by DMA).", choices=["dma", "kernel"]))
    snapshot_copy_programs: int = field(default=16, metadata=field_help(
        "With --ft-snapshot-copy-by kernel: programs (thread blocks) of the copy kernel, each looping over its "
        "share of the snapshot, so that the other SMs stay free for the training kernels; 0 = one per 16 KiB "
        "block (the whole GPU while it runs)."))

    def __post_init__(self) -> None:
        policy_class(self.policy)  # raises ValueError naming the choices
        for name in ("dense_interval", "pec_k", "snapshot_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"--ft-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        non_negative(self, ("sparse_window", "selective_local_budget", "selective_remote_budget",
                             "snapshot_write_threads", "snapshot_copy_piece_mb", "snapshot_copy_programs"), "ft_")
        if not 1 <= self.pec_k_persist <= self.pec_k:
            raise ValueError(f"--ft-pec-k-persist must be in [1, --ft-pec-k={self.pec_k}] (MoC §5.1: the durable "
                             f"tier holds a subset of each checkpoint's experts), got {self.pec_k_persist}")
        if self.snapshot_bandwidth <= 0:
            raise ValueError("--ft-snapshot-bandwidth must be positive (bytes/s)")
        if self.publish_by == "agent" and self.store_layout != "arena":
            raise ValueError("--ft-publish-by agent hands the node agent regions of the trainer's arena: it needs "
                             f"--ft-store-layout arena, got {self.store_layout!r}")

    def check_args(self, args) -> None:
        """Checks against the model's flags (``FTConfig.check_args``, at parsing)."""
        if self.snapshot_bubble_aware:
            check_pipeline(args.parallel.pipeline_model_parallel_size)

    @property
    def policy_cls(self):
        """The policy class (``None`` for ``--ft-policy none``)."""
        return policy_class(self.policy)

    @property
    def enabled(self) -> bool:
        return self.policy != NO_SNAPSHOTS

    def build(self, ctx: "BuildContext", *, job_suffix: str = "", replication: "ReplicationConfig | None" = None):
        """Policy + store + engine (collective-free; every rank builds the same policy), or ``None`` for
        ``--ft-policy none``. ``replication``: the replication flags, which bound the policy's budgets. See
        :func:`moe_ft.snapshot.session.build_session`."""
        if not self.enabled:
            return None

        return build_session(self, ctx, job_suffix=job_suffix, replication=replication)
