"""Asynchronous optimizer recomputation on the replica peer (MoEtion §5.2, Algorithm 3).

Selective checkpointing (MoEtion §4) saves the same experts FULL over short *stable periods*. Instead of
sending an expert's FULL state (compute weights, master, Adam ``exp_avg``/``exp_avg_sq``/``step``) to the
replica peers at every iteration of such a period, the owner sends it once when the expert enters the
selection ("Optimizer+Model"), and then only the gradients the optimizer step consumed ("Gradients"); each
peer runs the same optimizer update on its copy and so keeps the FULL state itself. When the continuity
breaks (the expert left the selection, or a point in between was not sent) the FULL state is sent again.

Three pieces, independent of the transport (``recompute_stream.py`` carries them):

* :func:`transfer_types` — Algorithm 3 itself, a pure function.
* :class:`GradCapture` (owner) — a ``register_step_pre_hook`` on every inner torch optimizer that Megatron
  built: it copies, for the experts being tracked, the gradients the update reads *after* Megatron's
  unscaling and clipping (``MegatronOptimizer.step`` calls the inner ``step()`` last) and the param-group
  hyperparameters of that step (``lr``, ``betas``, ``eps``, ``weight_decay``, … the optimizer's
  ``defaults`` keys; the scheduler writes ``lr``/``weight_decay`` into the groups before the step).
* :class:`ShadowExpert` (peer) — the expert's FULL entry tensors, decoded from the owner's entry, updated in
  place by an optimizer of the owner's class built with the owner's hyperparameters, then encoded again in
  the store's entry format. The result is the owner's FULL entry at that iteration byte for byte; the
  receiver verifies it against the checksum in the owner's manifest like any replicated entry.

Exactness needs the same arithmetic on both sides: the owner's inner optimizer must be torch's ``Adam`` /
``AdamW`` (what Megatron-Core builds without Transformer Engine and Apex) over host tensors, with
``FP32Optimizer`` or ``Float16OptimizerWithFloat16Params`` (whose model weights are a cast of the master,
``_copy_main_params_to_model_params``); :meth:`GradCapture.from_megatron` refuses other layouts with the
reason. The shadow uses the owner's group flags verbatim (``foreach``/``fused`` ``None`` resolve alike for
host tensors: the single-tensor loop), and the update of one parameter does not depend on the others of
its group, so a shadow over one expert's parameters reproduces the owner's step of the whole group.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from moe_ft.replication.recompute_limits import DISTRIBUTED_OPTIMIZER, FP8_WEIGHTS, GROUPED_MLP
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.optimizer_views import leaf_optimizers
from moe_ft.store.codec import read_entry, write_entry
from moe_ft.store.manifest import entry_key

GRADIENTS = "Gradients"
OPTIMIZER_MODEL = "Optimizer+Model"


def transfer_types(previous: Iterable[OperatorId], current: Iterable[OperatorId], *,
                   checkpoint_interval: int = 1) -> dict[OperatorId, str]:
    """MoEtion Algorithm 3: for each expert of ``current`` (checkpointed now), ``"Gradients"`` if it was
    checkpointed at the previous checkpoint too (the peer holds its state one step behind), else
    ``"Optimizer+Model"``. With ``checkpoint_interval`` > 1 the peer's state is several steps behind and
    every expert is ``"Optimizer+Model"`` (lines 1-6)."""
    if checkpoint_interval < 1:
        raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
    prev = frozenset(previous) if checkpoint_interval == 1 else frozenset()
    return {op: GRADIENTS if op in prev else OPTIMIZER_MODEL for op in current}


# ------------------------------------------------------------------------------------------------ owner
@dataclass(frozen=True)
class MainParam:
    """Where the update of one model parameter happens: the inner torch optimizer, its param group and the
    tensor that optimizer updates (the parameter itself, or its fp32 master)."""

    inner: torch.optim.Optimizer
    group_idx: int
    main: torch.Tensor


@dataclass
class ParamGrad:
    """What the update of one parameter at one iteration read: its gradient (``None``: the optimizer
    skipped it, no gradient) and its group's hyperparameters."""

    grad: torch.Tensor | None
    hyper: dict
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "step")
    """The inner optimizer's state tensors of the parameter (entry names ``<key>.<name>``)."""


def _supported_inner(inner) -> None:
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"--ft-optimizer-recompute replays the update with torch's Adam/AdamW on the peer; this "
                         f"job's optimizer is {type(inner).__module__}.{type(inner).__name__} (e.g. Transformer "
                         "Engine's or Apex's FusedAdam), whose update the peer cannot reproduce bitwise; run "
                         "without --ft-optimizer-recompute")


def main_params(registry, optimizer, ops: Iterable[OperatorId]) -> dict[OperatorId, dict[str, MainParam]]:
    """``op -> {parameter name (as in the FULL entry) -> MainParam}`` for the expert operators ``ops``.

    A parameter's inner optimizer is found through its Adam state: the registry's ``exp_avg.<name>`` view
    is the very tensor the inner optimizer keeps for its main parameter. Raises ``ValueError`` naming the
    fix for layouts the peer cannot reproduce (distributed optimizer, GroupedMLP, FP8, device tensors)."""

    by_state: dict[int, MainParam] = {}
    for leaf in leaf_optimizers(optimizer):
        if isinstance(leaf, DistributedOptimizer):
            raise ValueError(DISTRIBUTED_OPTIMIZER)
        inner = leaf.optimizer
        if inner is None:
            continue
        _supported_inner(inner)
        for gi, group in enumerate(inner.param_groups):
            for p in group["params"]:
                st = inner.state.get(p, {})
                if "exp_avg" in st:
                    by_state[id(st["exp_avg"])] = MainParam(inner, gi, p)
    out: dict[OperatorId, dict[str, MainParam]] = {}
    for op in ops:
        state = registry[op]
        if state.wide:
            raise ValueError(f"{op}: {FP8_WEIGHTS}")
        if state.shards:
            raise ValueError(f"{op}: {DISTRIBUTED_OPTIMIZER}")
        params = {}
        for name in state.compute:
            avg = state.optim.get(f"exp_avg.{name}")
            if avg is None:
                continue  # frozen parameter: no update to replay
            mp = by_state.get(id(avg))
            if mp is None:
                raise ValueError(f"{op}: {name} is a GroupedMLP view. {GROUPED_MLP}")
            if mp.main.device.type != "cpu":
                raise ValueError(f"{op}: {name} is updated on {mp.main.device}; the peer replays updates on "
                                 "the host and would not be bitwise equal; run without --ft-optimizer-recompute")
            params[name] = mp
        if params:
            out[op] = params
    return out


class GradCapture:
    """Owner side: copies the gradients and hyperparameters of the tracked experts at every inner optimizer
    step (a step pre-hook). ``begin(t)`` names the iteration whose step comes next; ``track(ops)`` the
    experts whose gradients the following steps capture (those FULL in the newest snapshot: the only ones
    Algorithm 3 may send as gradients next). ``take(t)`` hands a sender the captures of iteration ``t``."""

    def __init__(self, params: Mapping[OperatorId, Mapping[str, MainParam]], *, keep: int = 4) -> None:
        self.params = {op: dict(p) for op, p in params.items()}
        self.keep = keep
        self._tracked: frozenset[OperatorId] = frozenset()
        self._iteration: int | None = None
        self._captured: dict[int, dict[OperatorId, dict[str, ParamGrad]]] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0
        """Time the hook spent on the training thread (gradient clones)."""
        inners: dict[int, torch.optim.Optimizer] = {}
        for p in self.params.values():
            for mp in p.values():
                inners[id(mp.inner)] = mp.inner
        self._handles = [inner.register_step_pre_hook(self._hook) for inner in inners.values()]

    @classmethod
    def from_megatron(cls, registry, optimizer) -> "GradCapture":
        """Every expert operator of this rank (see :func:`main_params` for what is refused)."""
        return cls(main_params(registry, optimizer, [op for op in registry if op.is_expert]))

    def begin(self, iteration: int) -> None:
        """The next optimizer step is the one of ``iteration`` (training thread)."""
        self._iteration = iteration

    def track(self, ops: Iterable[OperatorId]) -> None:
        """Capture these experts from the next step on (training thread); older captures are dropped."""
        self._tracked = frozenset(op for op in ops if op in self.params)
        with self._lock:
            for it in sorted(self._captured)[:-self.keep or None]:
                del self._captured[it]

    def _hook(self, optimizer, args, kwargs) -> None:
        t = self._iteration
        if t is None or not self._tracked:
            return
        start = time.perf_counter()
        got: dict[OperatorId, dict[str, ParamGrad]] = {}
        for op in self._tracked:
            for name, mp in self.params[op].items():
                if mp.inner is not optimizer:
                    continue
                group = optimizer.param_groups[mp.group_idx]
                hyper = {k: group[k] for k in optimizer.defaults}
                grad = mp.main.grad
                keys = tuple(k for k, v in optimizer.state.get(mp.main, {}).items() if isinstance(v, torch.Tensor))
                got.setdefault(op, {})[name] = ParamGrad(None if grad is None else grad.detach().clone(), hyper,
                                                         keys)
        with self._lock:
            mine = self._captured.setdefault(t, {})
            for op, grads in got.items():
                mine.setdefault(op, {}).update(grads)
        self.seconds += time.perf_counter() - start

    def take(self, iteration: int, ops: Iterable[OperatorId]) -> dict[OperatorId, dict[str, ParamGrad]]:
        """The complete captures (every parameter of the expert) of ``iteration`` for ``ops``."""
        with self._lock:
            mine = self._captured.get(iteration, {})
            return {op: dict(mine[op]) for op in ops if op in mine and mine[op].keys() == self.params[op].keys()}

    def complete(self, iteration: int, ops: Iterable[OperatorId]) -> frozenset[OperatorId]:
        """Those of ``ops`` whose every parameter's update of ``iteration`` was captured."""
        with self._lock:
            mine = self._captured.get(iteration, {})
            return frozenset(op for op in ops if op in mine and mine[op].keys() == self.params[op].keys())

    def release(self, up_to: int) -> None:
        """Drop the captures of iterations ``<= up_to`` (sent, or superseded)."""
        with self._lock:
            for it in [it for it in self._captured if it <= up_to]:
                del self._captured[it]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------- peer
@dataclass
class ShadowExpert:
    """Peer side: one expert's FULL entry tensors at ``iteration`` (in the entry's order), updated in place.

    Entry names (``moe_ft.state.registry``): compute ``<name>``, master ``master.<name>`` (absent when the
    compute weight is the fp32 master itself), optimizer state ``<key>.<name>``."""

    op: OperatorId
    iteration: int
    tensors: dict[str, torch.Tensor]
    _optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)

    @classmethod
    def from_entry(cls, op: OperatorId, iteration: int, data: bytes, *, checksum: str, algo: str) -> "ShadowExpert":
        """Decode (and verify) the owner's FULL entry of ``op`` at ``iteration``."""
        decoded = read_entry(io.BytesIO(data), size=len(data), checksum=checksum, algo=algo,
                             key=entry_key(iteration, op, Level.FULL), where=f"{op}@FULL iteration {iteration}")
        return cls(op, iteration, decoded.tensors)

    def _optimizer(self, name: str, cls: type, pg: ParamGrad) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        main = self.tensors.get(f"master.{name}", self.tensors.get(name))
        missing = [k for k in pg.state_keys if f"{k}.{name}" not in self.tensors]
        if main is None or missing:
            raise ValueError(f"{self.op}: the FULL entry lacks {name!r} or its optimizer state {missing}")
        opt = self._optimizers.get(name)
        if opt is None:
            opt = cls([main])  # every hyperparameter is the owner's: set below, at every step
            opt.state[main] = {k: self.tensors[f"{k}.{name}"] for k in pg.state_keys}
            self._optimizers[name] = opt
        group = opt.param_groups[0]
        unknown = sorted(set(pg.hyper) - set(group))
        if unknown:
            raise ValueError(f"{self.op}: the owner's optimizer has hyperparameters {unknown} that "
                             f"{cls.__name__} here does not; both ends must run the same torch version")
        group.update(pg.hyper)
        return opt, main

    def apply(self, iteration: int, grads: Mapping[str, ParamGrad], cls: type) -> None:
        """The owner's optimizer step of ``iteration`` (this shadow must be at ``iteration - 1``)."""
        if iteration != self.iteration + 1:
            raise ValueError(f"{self.op}: gradients of iteration {iteration} for a state at {self.iteration}")
        for name, pg in grads.items():
            if pg.grad is None:
                continue  # the owner's optimizer skipped this parameter too (no gradient)
            opt, main = self._optimizer(name, cls, pg)
            main.grad = pg.grad
            opt.step()
            main.grad = None
            if f"master.{name}" in self.tensors:  # model weight = cast of the master (Float16Optimizer)
                self.tensors[name].copy_(main)
        self.iteration = iteration

    def encode(self, algo: str) -> bytes:
        """The FULL entry at :attr:`iteration` in the store's format (identical bytes to the owner's)."""
        parts: list[bytes] = []
        write_entry(lambda b: parts.append(bytes(b)), entry_key(self.iteration, self.op, Level.FULL),
                    self.tensors, algo)
        return b"".join(parts)
