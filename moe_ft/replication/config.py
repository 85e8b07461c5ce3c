"""The replication component's flags (``--ft-replicas``, ``--ft-ranks-per-node``, ``--ft-optimizer-recompute``,
...) and its build: the sender and receiver of peer replicas (``moe_ft/replication/service.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.training.argument_utils import field_help, non_negative
from moe_ft.replication.recompute_limits import DISTRIBUTED_OPTIMIZER, FP8_WEIGHTS, GROUPED_MLP

if TYPE_CHECKING:
    from moe_ft.runtime.context import BuildContext


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
        "(MoEtion §4.2); the newest recovery point goes first, older ones are skipped (0 = unlimited). Also "
        "bounds the snapshots: the sparse window (--ft-sparse-window 0) and selective's B_remote are sized so "
        "that --ft-replicas copies of each snapshot fit it (on a job of one node, which sends no replicas, too)."))
    replicate_by: str = field(default="trainer", metadata=field_help(
        "Who moves the replicas: 'trainer' (threads of the training process, over a dedicated gloo group) or "
        "'agent' (the node agents: the trainer names each published point to its node's agent, which reads it "
        "from the store and sends it over TCP to the peers' agents, which verify and publish it; no payload "
        "byte passes through a trainer). The agents listen on $MOE_FT_AGENT_HOST (default: the host name's "
        "address). Not with --ft-optimizer-recompute.", choices=("trainer", "agent")))
    optimizer_recompute: bool = field(default=False, metadata=field_help(
        "Asynchronous optimizer recomputation (MoEtion §5.2, Alg. 3): an expert FULL in consecutive points is "
        "sent to the peers as the gradients of its step, and each peer replays the optimizer update to keep "
        "its FULL state (fp32/bf16 torch Adam, no distributed optimizer, SequentialMLP experts, no "
        "--fp8-emulation); needs --ft-replicas and --ft-policy selective."))
    optimizer_recompute_local: str = field(default="full", metadata=field_help(
        "What the owner snapshots of an expert sent as gradients (--ft-optimizer-recompute): 'full' writes its "
        "FULL state locally as well (a local restart needs no peer); 'compute' writes only its compute "
        "weights and a checksum of the FULL state, which the peers rebuild (MoEtion §5.2: 2/3 fewer local "
        "bytes for such experts in fp32). A restart then fetches those FULL entries from the peers; without "
        "them recovery falls back to the newest point this node holds whole.",
        choices=("full", "compute")))

    def __post_init__(self) -> None:
        non_negative(self, ("replicas", "ranks_per_node", "replication_bandwidth"), "ft_")
        if self.optimizer_recompute and not self.replicas:
            raise ValueError("--ft-optimizer-recompute recomputes optimizer steps on replica peers; it needs "
                             "--ft-replicas >= 1")
        if self.replicate_by not in ("trainer", "agent"):
            raise ValueError(f"--ft-replicate-by must be 'trainer' or 'agent', got {self.replicate_by!r}")
        if self.replicate_by == "agent" and self.optimizer_recompute:
            raise ValueError("--ft-optimizer-recompute replays optimizer steps in the receiving trainer; the node "
                             "agents only move bytes: pass --ft-replicate-by trainer or drop --ft-optimizer-recompute")
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

    def check_args(self, args) -> None:
        """Checks against the model's flags (``FTConfig.check_args``, at parsing): the layouts whose expert
        updates a peer cannot replay (``recompute_limits.py``; the built optimizer is checked again in
        ``optim_recompute.main_params``)."""
        if not self.optimizer_recompute:
            return
        m = args.model
        if args.parallel.use_distributed_optimizer:
            raise ValueError(DISTRIBUTED_OPTIMIZER)
        if m.moe_grouped_gemm and m.transformer_impl == "local":
            raise ValueError(GROUPED_MLP)
        if m.fp8_format and any(extra.emulates_fp8 for extra in args.extra.values()):
            raise ValueError(FP8_WEIGHTS)

    def build(self, ctx: "BuildContext", session):
        """The replication component of ``session``'s store (collective), or ``None`` (no store, r = 0, or a
        job that runs on one node and never replicated: nothing to send, nothing to fetch)."""
        if session is None or not self.replicas:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft import comm
        from moe_ft.replication.component import Replicas
        from moe_ft.replication.receiver import points_to_keep
        from moe_ft.replication.service import Layout, ReplicaFetch, Replication

        layout = Layout.gather(ranks_per_node=self.ranks_per_node,
                               distributed_optimizer=ctx.args.parallel.use_distributed_optimizer)
        service = Replication.build(num_replicas=self.replicas, layout=layout, store=session.store,
                                    store_root=session.store_root, job_id=session.job_id,
                                    remote_budget=self.remote_budget(ctx), recompute=self.recompute(ctx),
                                    compute_only=self.optimizer_recompute_local == "compute",
                                    agent=self.agent_client(ctx, session),
                                    keep_points=lambda: points_to_keep(session.policy))
        planned = None
        if layout.simulated:  # one store root for every simulated node: the plan says what each holds
            planned = service.plan.sources[layout.rank] if service is not None else ()
        fetch = ReplicaFetch(layout, store_root=session.store_root, job_id=session.job_id, planned=planned)
        # collective: the ranks now on one node still fetch what earlier generations replicated
        if service is None and not comm.max_over_ranks(int(bool(fetch.owners_here()))):
            return None
        return Replicas(service, fetch)

    def agent_client(self, ctx: "BuildContext", session):
        """``--ft-replicate-by agent``: this rank's connection to its node agent (started if the node has
        none), else ``None``."""
        if self.replicate_by != "agent":
            return None

        # start-up time: the agent's client is imported only when the mode is on
        import os

        from moe_ft.agent.client import AgentClient

        ft = ctx.args.extra.get("FTConfig")
        idle = ft.persist.agent_idle_exit if ft is not None else 600.0
        return AgentClient(os.path.join(session.store_root, session.job_id, "agent"), ctx.rank, idle_exit_s=idle)

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
