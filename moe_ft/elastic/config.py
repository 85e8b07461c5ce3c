"""Flags of the elastic (Lazarus) MoE layer and the fixed replica map they describe.

``--moe-token-dispatcher-type flexible`` installs the flexible dispatcher; these ``--ft-*`` flags say which
expert replicas every EP rank holds. An EP rank plays the role of a Lazarus "node" with
``--ft-expert-slots`` replica slots. Explicit counts and ``--ft-expert-loads`` give one plan for every MoE
layer; ``--ft-expert-loads-from`` (popularity counters measured by an earlier run, ``loads.py``) gives every
layer its own. A layer's plan is the same in every EP group (it is indexed by EP rank, so Megatron's
expert-data-parallel gradient reduction pairs identical parameters). The plan changes with ``--ft-elastic``
after a restart on another world (``moe_ft/elastic/restart.py``) and with ``--ft-rebalance-interval`` inside the
running job (``moe_ft/elastic/rebalance_component.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.training.extensions import LoopExtension
from moe_ft.megatron_ext.dispatch.arithmetic import BACKENDS, FLEXIBLE, check_flexible_model
from moe_ft.placement.allocation import allocate_replicas, held_fault_threshold
from moe_ft.placement.layers import STRATEGIES, ExpertPlacementConfig, place, plan_layer
from moe_ft.placement.loads import MeasuredLoads, read_trace_loads
from moe_ft.placement.plans import plan_counts, validate_plan


def field_help(help_text: str, **extra) -> dict:
    """Field metadata read by the flag builder (``megatron/training/argument_utils.py``): help and choices."""
    return {"help": help_text, **extra}


@dataclass(kw_only=True)
class ElasticConfig(LoopExtension):
    """Replica plan of the flexible dispatcher (Lazarus §4.1 allocation + placement, fixed for the run)."""

    ft_expert_replicas: list[str] | None = field(default=None, metadata=field_help(
        "Replicas per expert (one count per expert, summing to EP size x --ft-expert-slots), or 'auto' for "
        "Lazarus eq. 1 from --ft-expert-loads-from (per layer) or --ft-expert-loads. Unset: one replica per "
        "expert where standard EP puts it. Needs --moe-token-dispatcher-type flexible."))
    """``None``, ``["auto"]`` or one integer string per expert."""
    ft_expert_slots: int | None = field(default=None, metadata=field_help(
        "Replica slots per EP rank (Lazarus c; default num_experts / EP size)."))
    """``c``: replicas one EP rank holds; with several slots of one expert a rank takes a larger share."""
    ft_fault_threshold: int = field(default=1, metadata=field_help(
        "Minimum replicas per expert (Lazarus f) for 'auto' and, with --ft-elastic, every re-plan (lowered to "
        "what a smaller world holds): any f-1 failed EP ranks are survivable."))
    """``f`` of eq. 1: used by ``auto`` and, with ``--ft-elastic``, by every re-plan (restart, fallback, in-run
    rebalance), lowered to what that world's slots hold."""
    ft_expert_loads: list[float] | None = field(default=None, metadata=field_help(
        "Expected tokens per expert for 'auto' (default: uniform)."))
    """Popularity fed to eq. 1; one non-negative number per expert, the same for every MoE layer."""
    ft_expert_loads_from: str = field(default="", metadata=field_help(
        "--ft-trace-out file of an earlier run: its popularity counters, summed per MoE layer, are the loads "
        "of 'auto', and every layer gets its own allocation and plan."))
    """Path of a JSONL trace (``moe_ft.placement.loads``); read once, at argument parsing."""
    ft_expert_loads_window: int = field(default=0, metadata=field_help(
        "With --ft-expert-loads-from: sum only the newest N iterations of the trace (0 = all)."))
    """Recent-history window of the measured loads, in iterations."""
    ft_placement: str = field(default="optimal", metadata=field_help(
        "Placement strategy of the replicas over EP ranks.", choices=list(STRATEGIES)))
    """``optimal`` (never worse than MRO), ``mro``, ``spread`` or ``compact``."""
    ft_dispatch_backend: str = field(default="torch", metadata=field_help(
        "Permutation implementation: torch (reference) or triton (explicit opt-in).", choices=list(BACKENDS)))
    """``DispatchConfig.backend`` of the flexible dispatcher."""

    ft_elastic: bool = field(default=False, metadata=field_help(
        "Keep training on the world torchrun gives after a restart (--nnodes MIN:MAX): a lost node need not "
        "be replaced; every MoE layer is re-planned for the new world from the current loads and each "
        "expert's state moves from its surviving holders (Lazarus §4.3; docs/elastic.md). Needs --ft, "
        "the flexible dispatcher and snapshots."))
    """Re-plan replicas when the world size changes between restarts (``moe_ft/elastic/restart.py``)."""

    ft_rebalance_interval: int = field(default=0, metadata=field_help(
        "Every N iterations re-allocate and re-place every MoE layer's expert replicas from the recent loads "
        "(Lazarus §4.3/§5: eq. 1, fewest moves) inside the running job, moving only the experts a rank gains "
        "(weights, fp32 master, Adam moments); 0 = never. Each EP rank keeps --ft-expert-slots MLPs. Needs "
        "--ft-elastic (docs/elastic.md)."))
    """Iterations between in-run rebalances (``moe_ft/elastic/rebalance_component.py``)."""

    measured: MeasuredLoads | None = field(default=None, init=False, repr=False)
    """Per-layer loads read from ``ft_expert_loads_from`` (not a flag)."""
    restart: object = field(default=None, init=False, repr=False)
    """``--ft-elastic``: the ``RestartDecision`` agreed at model build (``None`` before; not a flag)."""
    launched_world: int = field(default=0, init=False, repr=False)
    """``--ft-elastic``: the world the launcher started (``WORLD_SIZE``); ``args.world_size`` is the part of it
    that trains (:func:`~moe_ft.elastic.reshape.usable_world_size`), the ranks beyond wait as spares (not a
    flag; 0 before :meth:`adjust_parallel`)."""
    _ft: object = field(default=None, init=False, repr=False)
    _num_layers: int = field(default=0, init=False, repr=False)
    _pipeline_size: int = field(default=1, init=False, repr=False)

    def __post_init__(self):
        r = self.ft_expert_replicas
        if r is not None and r != ["auto"]:
            try:
                counts = [int(x) for x in r]
            except ValueError:
                raise ValueError(f"--ft-expert-replicas takes 'auto' or one integer per expert, got {r}") from None
            if any(c < 1 for c in counts):
                raise ValueError(f"--ft-expert-replicas: every expert needs at least one replica, got {counts}")
        if self.ft_expert_slots is not None and self.ft_expert_slots < 1:
            raise ValueError(f"--ft-expert-slots must be >= 1, got {self.ft_expert_slots}")
        if self.ft_fault_threshold < 1:
            raise ValueError(f"--ft-fault-threshold must be >= 1, got {self.ft_fault_threshold}")
        if self.ft_expert_loads is not None and r != ["auto"]:
            raise ValueError("--ft-expert-loads is only used with --ft-expert-replicas auto; drop one of them")
        if self.ft_rebalance_interval < 0:
            raise ValueError(f"--ft-rebalance-interval must be >= 0, got {self.ft_rebalance_interval}")
        if self.ft_rebalance_interval and not self.ft_elastic:
            raise ValueError("--ft-rebalance-interval re-plans the replicas of a running job and records the plans "
                             "the way --ft-elastic does (restarts must know the plan in force); add --ft-elastic")
        if self.ft_expert_loads_from:
            if r != ["auto"]:
                raise ValueError("--ft-expert-loads-from is only used with --ft-expert-replicas auto; add it or "
                                 "drop --ft-expert-loads-from")
            if self.ft_expert_loads is not None:
                raise ValueError("--ft-expert-loads and --ft-expert-loads-from both give the loads; pass one")
            self.measured = read_trace_loads(self.ft_expert_loads_from, self.ft_expert_loads_window)
        elif self.ft_expert_loads_window:
            raise ValueError("--ft-expert-loads-window needs --ft-expert-loads-from")

    def adjust_parallel(self, args) -> list[str]:
        """``--ft-elastic``: the EP size for the world torchrun gave this start (``reshape.usable_world_size``;
        a shrunken world may no longer be divisible by the flag's EP size). Meant to run before Megatron's
        argument validation; returns the log lines of what changed (none when nothing did)."""
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.elastic.reshape import usable_world_size

        if not self.ft_elastic:
            return []

        p, m, t = args.parallel, args.model, args.training
        tp = p.tensor_model_parallel_size
        etp = p.expert_tensor_parallel_size or tp
        if (tp, etp) != (1, 1):
            # the flexible dispatcher runs whole experts on one rank each (no TP, no ETP), and the EP arithmetic
            # below counts a stage's ranks as EP candidates; refused here, before it re-derives a wrong EP size
            raise ValueError(f"--ft-elastic re-plans whole experts on the flexible dispatcher, which covers neither "
                             f"tensor nor expert tensor parallelism (got TP {tp}, ETP {etp}); drop "
                             f"--tensor-model-parallel-size / --expert-tensor-parallel-size")
        ep = p.expert_model_parallel_size
        slots = self.ft_expert_slots if self.ft_expert_slots is not None else m.num_experts // ep
        sizes = dict(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, ep=ep,
                     num_experts=m.num_experts, slots=slots, min_replicas=self.ft_fault_threshold)
        if t.global_batch_size is None:
            # Megatron's default (one micro-batch per data-parallel rank) follows the world: a shrink would train
            # another global batch, and the restore refuses it (docs/recovery.md); refused at the start instead
            dp = args.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) or 1
            raise ValueError(f"--ft-elastic keeps the global batch over a shrink or grow, so it must be fixed: pass "
                             f"--global-batch-size (e.g. {t.micro_batch_size * dp}, --micro-batch-size x the "
                             f"data-parallel size of this world)")
        # the global batch stays: a world it does not split over trains on fewer ranks
        usable = usable_world_size(args.world_size, global_batch=t.global_batch_size,
                                   micro_batch=t.micro_batch_size, **sizes)
        change, self.launched_world = usable.change, args.world_size
        args.world_size = usable.usable
        if change.ep_size != ep:
            p.expert_model_parallel_size = change.ep_size
            if self.ft_expert_slots is None:
                self.ft_expert_slots = slots  # c is memory: it stays what it was on the original world
        return list(change.notes)

    def check_args(self, args) -> None:
        """Parse-time checks against the model flags (``megatron/training/arguments.py`` calls this)."""
        m, p = args.model, args.parallel
        if self.enabled and m.moe_token_dispatcher_type != FLEXIBLE:
            raise ValueError(f"--ft-expert-replicas needs --moe-token-dispatcher-type {FLEXIBLE}")
        if m.moe_token_dispatcher_type == FLEXIBLE:  # what the elastic layer and its dispatcher refuse at build
            check_flexible_model(expert_tp_size=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
                                 capacity_factor=m.moe_expert_capacity_factor,
                                 sequential_experts=not m.moe_grouped_gemm)
            self.check_plan(m.num_experts, p.expert_model_parallel_size)
        if self.measured is not None:
            self.measured.check_model(args.model.num_layers, args.model.num_experts)
        if self.ft_elastic:
            ft = args.extra.get("FTConfig")
            if ft is None or not ft.ft or not ft.snapshot.enabled:
                raise ValueError("--ft-elastic restores expert state from snapshots: add --ft (and a snapshot "
                                 "policy other than none)")
            if args.model.moe_token_dispatcher_type != FLEXIBLE:
                raise ValueError(f"--ft-elastic re-plans expert replicas: add --moe-token-dispatcher-type {FLEXIBLE}")
            if args.parallel.num_layers_per_virtual_pipeline_stage or args.parallel.virtual_pipeline_model_parallel_size:
                raise ValueError("--ft-elastic keeps one model chunk per pipeline rank; drop "
                                 "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")
            self._ft, self._num_layers = ft, args.model.num_layers
            self._pipeline_size = args.parallel.pipeline_model_parallel_size
        if self.ft_rebalance_interval:
            if args.parallel.use_distributed_optimizer:
                raise ValueError("--ft-rebalance-interval moves experts between MLP slots in the running job, "
                                 "and the distributed optimizer shards each slot's state differently; drop "
                                 "--use-distributed-optimizer or --ft-rebalance-interval")
            ft = args.extra.get("FTConfig")
            if not getattr(ft.snapshot.policy_cls, "starts_dense", False):
                raise ValueError(f"--ft-rebalance-interval: a rebalance starts the new plan with a dense recovery "
                                 f"point, which --ft-policy {ft.snapshot.policy} cannot take (use sparse or dense)")

    @property
    def per_layer(self) -> bool:
        """Whether every MoE layer has its own plan (loads measured per layer, or re-planned elastically)."""
        return self.measured is not None or self.ft_elastic

    @property
    def enabled(self) -> bool:
        """Whether any replica flag asks for the elastic layer."""
        return self.ft_expert_replicas is not None

    def customize_layer_spec(self, spec):
        """Layer-spec seam of ``megatron/training/model.py``: the MoE MLP becomes ``ElasticMoELayer``, which
        takes over Megatron's dispatcher switch only for ``--moe-token-dispatcher-type flexible``."""
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from moe_ft.megatron_ext.elastic_moe_layer import elastic_mlp_spec

        mlp = getattr(spec.submodules, "mlp", None)
        if mlp is None or not issubclass(getattr(mlp, "module", object), MoELayer):
            if self.enabled:
                raise ValueError("--ft-expert-replicas needs an MoE model (--num-experts)")
            return spec
        spec.submodules.mlp = elastic_mlp_spec(mlp, self)
        return spec

    def replica_map(self, num_experts: int, ep_size: int, layer_idx: int | None = None) -> torch.Tensor:
        """``R[e, j]``: replicas of expert ``e`` on EP rank ``j``, int64 ``[num_experts, ep_size]``, for MoE
        layer ``layer_idx`` (0-based global index; only needed when ``per_layer``)."""
        slots = self.ft_expert_slots if self.ft_expert_slots is not None else num_experts // ep_size
        if self.ft_elastic:
            if self.restart is None:  # first layer built: agree on this start's plans (collective)
                self.restart = self._decide(num_experts, ep_size, slots, layer_idx)
            plans = self.restart.plans
            if plans:
                if layer_idx is None or layer_idx not in plans:
                    raise RuntimeError(f"no re-planned replica map for MoE layer {layer_idx}")
                return torch.tensor(plans[layer_idx], dtype=torch.int64)
        if self.ft_expert_replicas is None:
            self._check_standard(num_experts, ep_size)
            plan = tuple(tuple(range(j * slots, (j + 1) * slots)) for j in range(ep_size))
        elif self.ft_expert_replicas == ["auto"]:
            if self.measured is not None:
                if layer_idx is None:
                    raise ValueError("loads measured per layer (--ft-expert-loads-from) need the layer index")
                loads = self.measured.layer(layer_idx)
                if len(loads) != num_experts:
                    raise ValueError(f"{self.measured.source} has loads of {len(loads)} experts for a model "
                                     f"with {num_experts}")
            else:
                loads = self._flag_loads(num_experts)
            config = ExpertPlacementConfig(slots_per_node=slots, min_replicas=self._fault_threshold(
                num_experts, ep_size, slots), strategy=self.ft_placement)
            plan = plan_layer(loads, ep_size, config).plan
        else:
            counts = self._counts(num_experts)
            fallback = self.restart if self.ft_elastic and self.restart is not None else None
            if sum(counts) != ep_size * slots and fallback is not None and fallback.kind == "fallback":
                # the counts were the launched world's; eq. 1 re-allocates the slots of this one (Lazarus §4.1)
                loads = fallback.previous.loads.get(layer_idx, [float(c) for c in counts])
                config = ExpertPlacementConfig(slots_per_node=slots, min_replicas=self._fault_threshold(
                    num_experts, ep_size, slots), strategy=self.ft_placement)
                return replica_map_from_plan(plan_layer(loads, ep_size, config).plan, num_experts)
            self._check_slots_filled(counts, ep_size, slots)
            plan = place(counts, ep_size, ExpertPlacementConfig(slots_per_node=slots, strategy=self.ft_placement))
        return replica_map_from_plan(plan, num_experts)

    def check_plan(self, num_experts: int, ep_size: int) -> None:
        """What :meth:`replica_map` would refuse on every rank at model build, from the flags alone
        (:meth:`check_args`, at parsing). With ``--ft-elastic`` only what no world changes: the plan (EP size,
        slots, fault threshold) is decided at build, from the snapshots."""
        slots = self.ft_expert_slots if self.ft_expert_slots is not None else num_experts // ep_size
        if self.ft_expert_replicas is None:
            if not self.ft_elastic:
                self._check_standard(num_experts, ep_size)
        elif self.ft_expert_replicas == ["auto"]:
            # measured loads were checked against the model (MeasuredLoads.check_model); eq. 1's refusals
            # (slots that cannot hold every expert f times) do not depend on the loads
            loads = self._flag_loads(num_experts) if self.measured is None else [1.0] * num_experts
            if not self.ft_elastic:
                try:
                    allocate_replicas(loads, num_nodes=ep_size, slots_per_node=slots,
                                      min_replicas=self.ft_fault_threshold)
                except ValueError as e:  # eq. 1 speaks of nodes, slots and f: name their flags
                    raise ValueError(f"--ft-expert-replicas auto on {ep_size} EP ranks (the nodes) with "
                                     f"--ft-expert-slots {slots} and --ft-fault-threshold {self.ft_fault_threshold} "
                                     f"(f): {e}") from None
        else:
            counts = self._counts(num_experts)
            if not self.ft_elastic:
                self._check_slots_filled(counts, ep_size, slots)

    def _check_standard(self, num_experts: int, ep_size: int) -> None:
        if self.ft_expert_slots not in (None, num_experts // ep_size) or num_experts % ep_size:
            raise ValueError(f"--ft-expert-slots {self.ft_expert_slots} without --ft-expert-replicas: the plan is "
                             f"standard EP (--num-experts {num_experts} / EP size {ep_size} slots per rank); pass "
                             "--ft-expert-replicas to use other slot counts, or drop --ft-expert-slots")

    def _flag_loads(self, num_experts: int) -> list[float]:
        loads = self.ft_expert_loads if self.ft_expert_loads is not None else [1.0] * num_experts
        if len(loads) != num_experts:
            raise ValueError(f"--ft-expert-loads has {len(loads)} values for {num_experts} experts (--num-experts)")
        return loads

    def _counts(self, num_experts: int) -> list[int]:
        counts = [int(x) for x in self.ft_expert_replicas or ()]
        if len(counts) != num_experts:
            raise ValueError(f"--ft-expert-replicas has {len(counts)} counts for {num_experts} experts "
                             "(--num-experts): give one count per expert")
        return counts

    @staticmethod
    def _check_slots_filled(counts: list[int], ep_size: int, slots: int) -> None:
        if sum(counts) != ep_size * slots:
            raise ValueError(f"--ft-expert-replicas sums to {sum(counts)} but EP size {ep_size} x "
                             f"--ft-expert-slots {slots} = {ep_size * slots} slots; make them agree")

    def _fault_threshold(self, num_experts: int, ep_size: int, slots: int) -> int:
        """``f`` of this world's eq. 1: with ``--ft-elastic`` the flag's lowered to what ``ep_size`` x ``slots``
        hold, as ``adjust_parallel`` announced and a reshape re-plans (the fallback of a shrunken world would
        otherwise die in eq. 1, or re-allocate with fewer copies than the world holds); else the flag's (an
        impossible one is eq. 1's error)."""
        if not self.ft_elastic:
            return self.ft_fault_threshold
        return held_fault_threshold(self.ft_fault_threshold, num_nodes=ep_size, slots_per_node=slots,
                                    num_experts=num_experts)

    def _decide(self, num_experts: int, ep_size: int, slots: int, first_layer: int | None):
        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.elastic.restart import decide

        ft = self._ft
        if ft is None:
            raise RuntimeError("--ft-elastic needs ElasticConfig.check_args(args) before the model is built")
        decision = decide(store_dir=ft.snapshot.store_dir, job_id=ft.snapshot.job_id, num_layers=self._num_layers,
                          num_experts=num_experts, ep_size=ep_size, slots=slots,
                          min_replicas=self.ft_fault_threshold, strategy=self.ft_placement,
                          pipeline_size=self._pipeline_size, first_layer=first_layer)

        if dist.get_rank() == 0 and decision.kind in ("reshape", "fallback"):
            for line in decision.notes + ([decision.reason] if decision.reason else []):
                print(f"moe-ft elastic: {line}", flush=True)
        return decision


def replica_map_from_plan(plan, num_experts: int) -> torch.Tensor:
    """``R[e, j]`` (int64 ``[num_experts, num_ranks]``) from a plan (``plan[j]``: experts in rank ``j``'s slots)."""
    counts = plan_counts(tuple(tuple(node) for node in plan), num_experts).T
    validate_plan(tuple(tuple(node) for node in plan), counts.sum(1).tolist(), len(plan[0]))
    if (counts.sum(1) == 0).any():
        raise ValueError(f"experts {(counts.sum(1) == 0).nonzero()[0].tolist()} have no replica in plan {plan}")
    return torch.from_numpy(counts.copy()).to(torch.int64)
