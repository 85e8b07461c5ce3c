"""Operator registry: this rank's Megatron-Core MoE model and optimizer, cut into operators.

For every operator held by this rank (its pipeline stage, its expert-parallel shard) the registry keeps
*views* — never copies — of

* the compute weights (the model parameters, plus the router's ``expert_bias`` buffer for a gate),
* the fp32 master weights, when they are separate tensors (see the aliasing rule below),
* the optimizer state (Adam ``exp_avg``, ``exp_avg_sq``, ``step``); with the distributed optimizer only
  the shard this data-parallel rank owns.

Tensor names inside an operator: ``<param name>`` (compute), ``master.<param name>``,
``<state key>.<param name>`` (``exp_avg.decoder.layers.0.mlp.router.weight`` …); ``GroupedMLP`` weights
get a ``#<local expert>`` suffix. With the distributed optimizer the master and the optimizer state of a
parameter are this rank's range of it, named with the range (``exp_avg@0:4096:16384.<param name>``,
``moe_ft/state/shards.py``): every copy of an entry says which elements it holds.

**Aliasing rule (byte accounting).** In fp32 training Megatron's optimizers update the parameter itself
(``FP32Optimizer``, and the ``DistributedOptimizer``'s fp32 shards are views of the parameter): the master
weight then *is* the compute weight. Such a master is not listed separately: ``bytes_full`` counts its
bytes once, in the compute weights, and :attr:`OperatorState.aliased_masters` names those parameters.
Restoring the compute weights restores the master. Every byte size is exactly the sum of ``nbytes`` of the
tensors :meth:`OperatorState.tensors` returns.

**FP8 weights** (MoEvement §5.7). A weight kept in FP8 (moe-ft's emulation, a Transformer Engine
``Float8Tensor``: ``moe_ft.precision.quantized``) has as compute weights its FP8 state — ``<param
name>.fp8_data`` (FP8 bytes), ``.fp8_scale_inv``, and the scaling state (``.fp8_scale``,
``.fp8_amax_history``, or TE's quantizer scale/amax) — stored as they are, never widened. The wide weight
the FP8 data is quantized from (the emulation's fp32/bf16 parameter; none for TE) is not read by forward:
it is saved with FULL only (``OperatorState.wide``; for fp32 training it is the aliased master). TE modules'
``fp8_meta`` scaling tensors are compute weights of the operator of the module's first parameter (of its
path for a module without parameters); TE creates them at a module's first FP8 forward, so a registry built
before any forward needs them created first (``moe_ft.precision.te_fp8.ensure_te_scaling_state``).
Buffers of a ``torch.float8_*`` dtype are compute weights of their operator.

Optimizer state is created by the first optimizer step (torch's Adam initialises lazily): build the
registry after iteration 0, and rebuild it after anything replaces state tensors (``load_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

import torch
from megatron.core import parallel_state as ps

from moe_ft.precision.quantized import QuantizedWeight, is_float8_dtype, quantized_state
from moe_ft.state import shards
from moe_ft.state.naming import grouped_expert_views, is_spare_expert, operator_of
from moe_ft.state.operators import Level, OperatorId, OperatorInfo
from moe_ft.state.optimizer_views import MainState, distributed_params, main_states


@dataclass(kw_only=True)
class OperatorState:
    """Views of one operator's state on this rank (see the module docstring for names and aliasing)."""

    op: OperatorId
    compute: dict[str, torch.Tensor] = field(default_factory=dict)
    master: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    aliased_masters: list[str] = field(default_factory=list)
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Distributed optimizer: ``param name -> (start, end)`` of the flattened parameter this rank owns."""
    sharded: dict[str, int] = field(default_factory=dict)
    """Distributed optimizer: ``param name -> numel`` of every parameter whose optimizer state is sharded
    over the data-parallel ranks, this rank's range empty or not (which elements a restore must find)."""
    wide: dict[str, torch.Tensor] = field(default_factory=dict)
    """Wide parameters that forward does not read because an FP8 copy of them is the compute weight (see
    the module docstring); FULL only."""
    after_restore: list = field(default_factory=list)
    """Callables to run after a restore overwrote the tensors (drop caches derived from FP8 data)."""
    forward_mutated: set[str] = field(default_factory=set)
    """Names of compute tensors that the next iteration writes in place before its optimizer step -- TE's
    delayed-scaling ``fp8_meta`` and quantizer scale/amax (at the end of each FP8 autocast region), the
    router's ``expert_bias`` (when the gradients are finalized) -- while the snapshot of this iteration may
    still be copying: the engine captures them when the snapshot is submitted."""

    def tensors(self, level: Level) -> dict[str, torch.Tensor]:
        """The tensors a snapshot at ``level`` holds: COMPUTE → compute weights; FULL → compute, wide
        weights, master and optimizer state; NONE → nothing."""
        if level == Level.FULL:
            return {**self.compute, **self.wide, **self.master, **self.optim}
        if level == Level.COMPUTE:
            return dict(self.compute)
        return {}

    def nbytes(self, level: Level) -> int:
        return sum(t.nbytes for t in self.tensors(level).values())

    def info(self, *, pp_rank: int, ep_rank: int) -> OperatorInfo:
        return OperatorInfo(op=self.op, bytes_compute=self.nbytes(Level.COMPUTE),
                            bytes_full=self.nbytes(Level.FULL), pp_rank=pp_rank, ep_rank=ep_rank)


class OperatorRegistry:
    """This rank's operators. Build with :meth:`from_megatron`; ``registry[op]`` is an
    :class:`OperatorState`."""

    def __init__(self, operators: Mapping[OperatorId, OperatorState], *, pp_rank: int, ep_rank: int,
                 ep_size: int = 1) -> None:
        self.operators = MappingProxyType(dict(sorted(operators.items())))
        self.pp_rank, self.ep_rank, self.ep_size = pp_rank, ep_rank, ep_size

    def __getitem__(self, op: OperatorId) -> OperatorState:
        try:
            return self.operators[op]
        except KeyError:
            raise KeyError(f"operator {op} is not held by this rank (pp {self.pp_rank}, ep {self.ep_rank})") from None

    def __contains__(self, op: OperatorId) -> bool:
        return op in self.operators

    def __iter__(self):
        return iter(self.operators)

    def __len__(self) -> int:
        return len(self.operators)

    def infos(self) -> list[OperatorInfo]:
        """This rank's :class:`OperatorInfo` list (local byte sizes, this rank's ``(pp_rank, ep_rank)``)."""
        return [s.info(pp_rank=self.pp_rank, ep_rank=self.ep_rank) for s in self.operators.values()]

    def nbytes(self, plan: Mapping[OperatorId, Level]) -> int:
        """Bytes this rank copies for ``plan`` (operators it does not hold are ignored)."""
        return sum(self.operators[op].nbytes(level) for op, level in plan.items() if op in self.operators)

    @classmethod
    def from_megatron(cls, model_chunks: Iterable, optimizer) -> "OperatorRegistry":
        """Decompose this rank's model chunks (``GPTModel`` or DDP-wrapped) and Megatron optimizer."""

        mains = main_states(optimizer)
        managed = distributed_params(optimizer)
        ops: dict[OperatorId, OperatorState] = {}
        seen: set[int] = set()
        state_of = lambda op: ops.setdefault(op, OperatorState(op=op))  # noqa: E731
        for chunk in model_chunks:
            gpt = getattr(chunk, "module", chunk)
            quantized, scaling = quantized_state(gpt)
            for name, param in gpt.named_parameters():
                seen.add(id(param))
                if is_spare_expert(name, gpt):  # an empty slot of the elastic layer: no operator's state
                    continue
                main = mains.get(id(param), (param, None))[1]
                op = operator_of(name, gpt)
                if main is None and id(param) in managed and op is not None:  # sharded, this rank's range empty
                    state_of(op).sharded[name] = param.numel()
                if op is None:
                    if name in quantized:
                        raise ValueError(f"{name}: FP8 GroupedMLP weights are not supported; use SequentialMLP "
                                         "(no --moe-grouped-gemm)")
                    _add_grouped(ops, gpt, name, param, main)
                elif name in quantized:
                    _add_quantized(state_of(op), name, param, main, quantized[name])
                else:
                    _add(state_of(op), name, param, main)
            for name, buf in gpt.named_buffers():
                if buf is not None and (name.endswith("mlp.router.expert_bias") or is_float8_dtype(buf.dtype)):
                    state_of(operator_of(name, gpt)).compute[name] = buf
                if buf is not None and name.endswith("mlp.router.expert_bias"):  # updated when grads finalize
                    state_of(operator_of(name, gpt)).forward_mutated.add(name)
            for name, (owner, tensor) in scaling.items():
                state_of(operator_of(owner, gpt)).compute[name] = tensor
                state_of(operator_of(owner, gpt)).forward_mutated.add(name)
        missing = [k for k in mains if k not in seen]
        if missing:
            raise RuntimeError(f"{len(missing)} optimizer parameters are not parameters of the model chunks given; "
                               "pass every model chunk of this rank")
        return cls(ops, pp_rank=ps.get_pipeline_model_parallel_rank(),
                   ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size())


def _add(state: OperatorState, name: str, param: torch.Tensor, main: MainState | None) -> None:
    state.compute[name] = param
    if main is not None:  # None: a frozen parameter, compute weights only
        _add_main(state, name, param, main)


def _add_main(state: OperatorState, name: str, param: torch.Tensor, main: MainState) -> None:
    """The optimizer's side of parameter ``name``: its fp32 master (or that the optimizer updates the parameter
    itself), its optimizer state and, with the distributed optimizer, the range this rank holds."""
    if main.master is None:
        state.aliased_masters.append(name)
    else:
        state.master[_state_name("master", name, param, main)] = main.master
    for key, value in main.state.items():
        state.optim[_state_name(key, name, param, main)] = value
    if main.shard is not None:
        state.shards[name] = main.shard
        state.sharded[name] = param.numel()


def _state_name(key: str, name: str, param: torch.Tensor, main: MainState) -> str:
    """``<key>.<name>``, or with the distributed optimizer the range-tagged name (``moe_ft/state/shards.py``)."""
    if main.shard is None:
        return f"{key}.{name}"
    return shards.tag(key, main.shard[0], main.shard[1], param.numel(), name)


def _add_quantized(state: OperatorState, name: str, param: torch.Tensor, main: MainState | None,
                   q: QuantizedWeight) -> None:
    """A weight whose compute state is FP8: its FP8 tensors are the compute weights, the wide parameter
    (if any) is saved with FULL only."""
    for suffix, tensor in q.tensors.items():
        state.compute[f"{name}.{suffix}"] = tensor
    state.forward_mutated.update(f"{name}.{suffix}" for suffix in q.forward_mutated)
    state.after_restore.extend(q.after_restore)
    if q.has_wide_copy:
        state.wide[name] = param
    if main is None:
        return
    if main.master is None and not q.has_wide_copy:
        raise ValueError(f"{name}: an FP8 parameter updated in place by the optimizer (no fp32 master); "
                         "FP8 parameters need a master weight")
    _add_main(state, name, param, main)


def _add_grouped(ops: dict, gpt, name: str, param: torch.Tensor, main: MainState | None) -> None:
    """``GroupedMLP``: per-expert views of the shared weight, master and (same-shaped) optimizer state."""
    if main is not None and main.shard is not None:
        raise ValueError(f"{name}: GroupedMLP weights with the distributed optimizer would need per-expert "
                         "slices of a flat shard; use SequentialMLP (no --moe-grouped-gemm) or the plain optimizer")
    layer_module = gpt.decoder.layers[int(name.split(".")[2])]
    moe = layer_module.mlp
    layer = int(layer_module.layer_number) - 1
    n = moe.num_local_experts
    compute = grouped_expert_views(name, param, n)
    master = grouped_expert_views(name, main.master, n) if main is not None and main.master is not None else None
    optim, scalars = {}, {}
    if main is not None:
        for key, value in main.state.items():
            if value.dim() == 0:  # Adam's step counter: one for the whole weight, kept with local expert 0
                scalars[key] = value
            elif value.shape == param.shape:
                optim[key] = grouped_expert_views(name, value, n)
            else:
                raise ValueError(f"{name}: optimizer state {key!r} of shape {tuple(value.shape)} cannot be cut "
                                 "per expert; the registry expects Adam state shaped like the weight")
    for j, expert in enumerate(moe.local_expert_indices):
        op = OperatorId.expert_op(layer, int(expert))
        st = ops.setdefault(op, OperatorState(op=op))
        st.compute[f"{name}#{j}"] = compute[j]
        if main is None:
            continue
        if master is None:
            st.aliased_masters.append(f"{name}#{j}")
        else:
            st.master[f"master.{name}#{j}"] = master[j]
        for key, views in optim.items():
            st.optim[f"{key}.{name}#{j}"] = views[j]
        if j == 0:
            for key, value in scalars.items():
                st.optim[f"{key}.{name}"] = value
