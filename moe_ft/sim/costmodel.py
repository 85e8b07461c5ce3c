"""Analytic cost model: state bytes per operator and per rank, and iteration time (MoEvement App. C).

Per rank, every stage is symmetric: a rank of stage ``s`` holds ``1/tp`` of each non-expert operator of
the stage and ``num_experts/ep`` experts of each MoE layer of the stage. Non-expert state is replicated
``dp`` times and expert state ``dp/ep`` times; with the distributed optimizer (ZeRO-1) master weights and
optimizer state are split over those replicas, and with fully sharded snapshots (MoC §2.3.2) the replicas
also split the copy of the compute weights.

Iteration time follows MoEvement App. C: per micro-batch stage time ``t_s`` (math at ``mfu`` of peak plus
expert all-to-all, tensor-parallel all-reduce and pipeline p2p, each with the NCCL affine model), the 1F1B
pipeline ``T_pipeline = (M + S - 1)·max_s t_s``, and ``T_iter = T_pipeline + T_sync + T_update``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from moe_ft.sim.config import DTYPE_BYTES, CollectiveCost, SimConfig
from moe_ft.state.operators import OperatorId


def pipeline_time_s(num_microbatches: int, stage_times_s: list[float]) -> float:
    """1F1B forward+backward time of one pipeline: ``(M + S - 1)·max_s t_s`` (MoEvement App. C)."""
    if num_microbatches < 1 or not stage_times_s:
        raise ValueError("need at least one micro-batch and one stage")
    return (num_microbatches + len(stage_times_s) - 1) * max(stage_times_s)


@dataclass(frozen=True)
class RankOperator:
    """One operator as seen by one rank of a stage: its snapshot bytes at FULL and at COMPUTE level."""

    op: OperatorId
    bytes_full: float
    bytes_compute: float
    flops_share: float  # share of the stage's per-token math this operator does on this rank (0..1)


@dataclass(frozen=True)
class IterationTime:
    """Breakdown of one iteration (seconds)."""

    stage_times_s: tuple[float, ...]  # per micro-batch, per stage: math + communication
    stage_math_s: tuple[float, ...]
    t_pipeline_s: float  # forward + backward of the whole pipeline (T_F&B in MoC eq. 10)
    t_sync_s: float  # exposed data-parallel gradient synchronisation
    t_update_s: float  # optimizer step

    @property
    def t_iter_s(self) -> float:
        return self.t_pipeline_s + self.t_sync_s + self.t_update_s


class CostModel:
    """Bytes and times for one :class:`SimConfig`. Pure arithmetic; cheap to build."""

    def __init__(self, config: SimConfig):
        self.config = config
        m = config.model
        self._mult = 3 if m.gated_ffn else 2
        self._attn = m.attention_params_per_layer or 4 * m.hidden_size**2
        self._rank_ops: dict[int, list[RankOperator]] = {}
        self._stage_ops: dict[int, list[OperatorId]] = {}

    # ---- parameters -------------------------------------------------------------------------------
    def expert_params(self) -> int:
        m = self.config.model
        return self._mult * m.hidden_size * m.moe_ffn_hidden_size

    def operator_params(self, op: OperatorId) -> int:
        """Parameters of one operator (whole, before any sharding)."""
        m = self.config.model
        h = m.hidden_size
        if op.kind in ("embedding",):
            return m.vocab_size * h
        if op.kind == "output":
            return 0 if (m.tie_embeddings and self.config.parallel.pp == 1) else m.vocab_size * h
        if op.kind == "gate":
            return h * m.num_experts + m.num_experts  # router weight + expert bias
        if op.kind == "expert":
            return self.expert_params()
        # dense(layer): attention, two norms, and the dense FFN or the shared experts
        params = self._attn + 2 * h
        if m.is_moe_layer(op.layer):
            params += m.num_shared_experts * self.expert_params()
        else:
            params += self._mult * h * m.ffn_hidden_size
        return params

    def total_params(self) -> int:
        return sum(self.operator_params(op) for s in range(self.config.parallel.pp) for op in self.stage_operators(s))

    def active_params(self) -> int:
        m = self.config.model
        num_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
        inactive = num_moe * (m.num_experts - m.top_k) * self.expert_params()
        return self.total_params() - inactive

    # ---- layout -----------------------------------------------------------------------------------
    @cached_property
    def _boundaries(self) -> tuple[int, ...]:
        """Contiguous split of the layers over the stages minimising the largest stage's math, counting
        the output layer on the last stage (what ``--decoder-last-pipeline-num-layers`` is for in
        Megatron). Dynamic programme over (stages, layers); every stage gets at least one layer."""
        m, pp = self.config.model, self.config.parallel.pp
        L = m.num_layers
        w = [self._op_token_flops(OperatorId.dense(i))
             + (self._op_token_flops(OperatorId.gate(i)) + m.num_experts * self._op_token_flops(
                 OperatorId.expert_op(i, 0)) if m.is_moe_layer(i) else 0.0) for i in range(L)]
        prefix = [0.0]
        for x in w:
            prefix.append(prefix[-1] + x)
        tail = self._op_token_flops(OperatorId.output())
        inf = float("inf")
        # best[s][j]: minimal max-weight placing layers [0, j) on stages [0, s)
        best = [[inf] * (L + 1) for _ in range(pp + 1)]
        cut = [[0] * (L + 1) for _ in range(pp + 1)]
        best[0][0] = 0.0
        for s in range(1, pp + 1):
            for j in range(s, L - (pp - s) + 1):
                for i in range(s - 1, j):
                    cost = prefix[j] - prefix[i] + (tail if s == pp else 0.0)
                    val = max(best[s - 1][i], cost)
                    if val < best[s][j]:
                        best[s][j], cut[s][j] = val, i
        bounds = [L]
        for s in range(pp, 0, -1):
            bounds.append(cut[s][bounds[-1]])
        return tuple(reversed(bounds))

    def stage_layers(self, stage_idx: int) -> range:
        """Layers of a stage (contiguous; see :attr:`_boundaries`)."""
        b = self._boundaries
        return range(b[stage_idx], b[stage_idx + 1])

    @cached_property
    def max_held_bytes(self) -> float:
        """Largest per-rank HBM state (compute + master + optimizer) over the stages."""
        return max(sum(self.rank_state_bytes(s).values()) for s in range(self.config.parallel.pp))

    def stage_operators(self, stage_idx: int) -> list[OperatorId]:
        """Every operator of a stage (all experts), in layer order."""
        if stage_idx not in self._stage_ops:
            self._stage_ops[stage_idx] = self._build_stage_operators(stage_idx)
        return self._stage_ops[stage_idx]

    def _build_stage_operators(self, stage_idx: int) -> list[OperatorId]:
        m = self.config.model
        ops = [OperatorId.embedding()] if stage_idx == 0 else []
        for layer in self.stage_layers(stage_idx):
            ops.append(OperatorId.dense(layer))
            if m.is_moe_layer(layer):
                ops.append(OperatorId.gate(layer))
                ops.extend(OperatorId.expert_op(layer, e) for e in range(m.num_experts))
        if stage_idx == self.config.parallel.pp - 1:
            ops.append(OperatorId.output())
        return ops

    def rank_operators(self, stage_idx: int) -> list[RankOperator]:
        """Operators held by one rank of a stage (its ``num_experts/ep`` experts per MoE layer, those of
        EP rank 0; all EP ranks are symmetric), with this rank's snapshot bytes."""
        if stage_idx not in self._rank_ops:
            self._rank_ops[stage_idx] = self._build_rank_operators(stage_idx)
        return self._rank_ops[stage_idx]

    def _build_rank_operators(self, stage_idx: int) -> list[RankOperator]:
        cfg = self.config
        p, prec = cfg.parallel, cfg.precision
        local_experts = cfg.model.num_experts // p.ep
        flops = self._stage_token_flops(stage_idx)
        out = []
        for op in self.stage_operators(stage_idx):
            if op.is_expert and op.expert >= local_experts:
                continue
            held = self.operator_params(op) / p.tp
            replicas = p.dp // p.ep if op.is_expert else p.dp
            compute = held * prec.compute_bytes / (replicas if p.shard_snapshots else 1)
            state_div = replicas if (p.shard_snapshots or p.distributed_optimizer) else 1
            full = compute + held * (prec.master_bytes + prec.optimizer_bytes) / state_div
            out.append(RankOperator(op, full, compute, self._op_token_flops(op) / flops if flops else 0.0))
        return out

    def rank_state_bytes(self, stage_idx: int) -> dict[str, float]:
        """Bytes one rank of a stage *holds* in HBM: compute weights, master weights, optimizer state."""
        cfg = self.config
        p, prec = cfg.parallel, cfg.precision
        local_experts = cfg.model.num_experts // p.ep
        res = {"compute": 0.0, "master": 0.0, "optimizer": 0.0}
        for op in self.stage_operators(stage_idx):
            if op.is_expert and op.expert >= local_experts:
                continue
            held = self.operator_params(op) / p.tp
            div = (p.dp // p.ep if op.is_expert else p.dp) if p.distributed_optimizer else 1
            res["compute"] += held * prec.compute_bytes
            res["master"] += held * prec.master_bytes / div
            res["optimizer"] += held * prec.optimizer_bytes / div
        return res

    def snapshot_bytes(self, stage_idx: int, level: str = "full") -> float:
        ops = self.rank_operators(stage_idx)
        return sum(o.bytes_full if level == "full" else o.bytes_compute for o in ops)

    # ---- time -------------------------------------------------------------------------------------
    def _op_token_flops(self, op: OperatorId) -> float:
        """Forward FLOPs per token of an operator (2 per multiply-add; causal attention ≈ 2·s·h)."""
        m = self.config.model
        if op.kind == "embedding":
            return 0.0
        if op.kind == "expert":  # each expert sees top_k/num_experts of the tokens on average
            return 2.0 * self.expert_params() * m.top_k / m.num_experts
        if op.kind == "dense":
            return 2.0 * self.operator_params(op) + 2.0 * m.seq_length * m.hidden_size
        return 2.0 * self.operator_params(op)

    def _stage_token_flops(self, stage_idx: int) -> float:
        return sum(self._op_token_flops(op) for op in self.stage_operators(stage_idx))

    def _bandwidth(self, group_span_ranks: int) -> float:
        hw = self.config.hardware
        return hw.nvlink_bandwidth if group_span_ranks <= hw.gpus_per_node else hw.network_bandwidth

    def collective_s(self, name: str, nbytes: float, group: int, span_ranks: int) -> float:
        """NCCL affine time ``α + β·m`` of one collective over ``group`` ranks whose ranks cover
        ``span_ranks`` consecutive global ranks (intra-node iff that span fits in one node)."""
        hw = self.config.hardware
        if group <= 1 and name != "p2p":
            return 0.0
        if name in hw.collectives:
            return hw.collectives[name].time_s(nbytes)
        frac = {"all_to_all": (group - 1) / group, "all_reduce": 2 * (group - 1) / group,
                "reduce_scatter": (group - 1) / group, "all_gather": (group - 1) / group, "p2p": 1.0}[name]
        return CollectiveCost(alpha_s=hw.collective_latency_s,
                              beta_s_per_byte=frac / self._bandwidth(span_ranks)).time_s(nbytes)

    def stage_time_s(self, stage_idx: int) -> tuple[float, float]:
        """(total, math-only) seconds of forward + backward of one micro-batch on one stage."""
        cfg = self.config
        m, p, hw, prec = cfg.model, cfg.parallel, cfg.hardware, cfg.precision
        tokens = p.micro_batch_size * m.seq_length
        rate = hw.peak_flops_fp8 if (prec.compute == "fp8" and hw.peak_flops_fp8 > 0) else hw.peak_flops_bf16
        math = 3.0 * tokens * self._stage_token_flops(stage_idx) / p.tp / (rate * hw.mfu)
        act = DTYPE_BYTES["bf16"]
        comm = 0.0
        for layer in self.stage_layers(stage_idx):
            if m.is_moe_layer(layer):
                dispatch = tokens / p.tp * m.top_k * m.hidden_size * prec.compute_bytes
                combine = tokens / p.tp * m.top_k * m.hidden_size * act
                # forward dispatch + combine, backward the same two in reverse
                comm += 2 * (self.collective_s("all_to_all", dispatch, p.ep, p.tp * p.ep)
                             + self.collective_s("all_to_all", combine, p.ep, p.tp * p.ep))
            comm += 4 * self.collective_s("all_reduce", tokens * m.hidden_size * act, p.tp, p.tp)
        if p.pp > 1:  # activation forward, its gradient backward
            comm += 2 * self.collective_s("p2p", tokens * m.hidden_size * act / p.tp, 2, 2 * p.tp * p.dp)
        return math + comm, math

    @cached_property
    def iteration(self) -> IterationTime:
        cfg = self.config
        p, prec, hw = cfg.parallel, cfg.precision, cfg.hardware
        times = [self.stage_time_s(s) for s in range(p.pp)]
        t_pipe = pipeline_time_s(p.num_microbatches, [t for t, _ in times])
        sync = update = 0.0
        for s in range(p.pp):
            ne = ex = 0.0  # params held by a rank: non-expert and expert
            for o in self.rank_operators(s):
                held = self.operator_params(o.op) / p.tp
                if o.op.is_expert:
                    ex += held
                else:
                    ne += held
            g = DTYPE_BYTES[prec.grad_reduce]
            stage_sync = 0.0
            for params, group in ((ne, p.dp), (ex, p.dp // p.ep)):
                if p.distributed_optimizer:
                    stage_sync += self.collective_s("reduce_scatter", params * g, group, p.tp * p.dp)
                    stage_sync += self.collective_s("all_gather", params * prec.compute_bytes, group, p.tp * p.dp)
                else:
                    stage_sync += self.collective_s("all_reduce", params * g, group, p.tp * p.dp)
            sync = max(sync, stage_sync)
            shard = (ne / p.dp + ex / (p.dp // p.ep)) if p.distributed_optimizer else ne + ex
            # read grad, read+write master and both moments, write compute weights
            touched = shard * (g + 2 * (prec.master_bytes + prec.optimizer_bytes)) + (ne + ex) * prec.compute_bytes
            update = max(update, touched / hw.hbm_bandwidth)
        exposed_sync = (1.0 - cfg.recovery.sync_overlap) * sync
        return IterationTime(tuple(t for t, _ in times), tuple(m for _, m in times), t_pipe, exposed_sync, update)

    def stage_replay_s(self, stage_idx: int, compute_factor: float = 1.0, *, segment: int = 1) -> float:
        """One iteration replayed by the data-parallel group of ``segment`` contiguous stages starting at
        ``stage_idx``, fed by logged activations/gradients of the healthy neighbours (MoEvement §3.4,
        App. A): no pipeline fill or drain of the healthy stages, ``(M + segment - 1)`` slots."""
        it = self.iteration
        stages = range(stage_idx, min(stage_idx + segment, self.config.parallel.pp))
        t_s = max(it.stage_times_s[s] for s in stages)
        slots = self.config.parallel.num_microbatches + len(stages) - 1
        return slots * t_s * compute_factor + it.t_sync_s + it.t_update_s
