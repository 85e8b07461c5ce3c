"""Expert popularity counters (MoEvement §3.5 and App. B, App. D; MoEtion §4.3; MoC §3.2).

One :class:`ExpertPopularity` per model replica. The router calls :meth:`ExpertPopularity.record` once per
micro-batch and MoE layer; the training loop calls :meth:`ExpertPopularity.end_iteration` once per
iteration, after the last micro-batch and before the policy plans that iteration's snapshot. Only
``end_iteration`` folds the micro-batch counts into the counters the policies read, and it is where the
optional ``all_reduce`` runs, so every rank holds bitwise identical counters afterwards (a policy must
produce the same plan on every rank).

Counters, all ``[num_layers, num_experts]`` float64 (exact for integer counts below 2**53):

* ``hard``: tokens routed to each expert since the start of training (``A_j^l``, MoEvement §3.5);
* ``soft``: sum of the gate probabilities given to each expert (MoEvement App. B, soft-count popularity);
* ``ema``: ``A(t) = alpha * A(t-1) + (1 - alpha) * count(t)`` per iteration (MoEvement App. B,
  time-decayed popularity; one mini-batch = one iteration);
* ``since_full``: tokens routed to each expert since its last FULL snapshot (MoEtion §4.3 "token
  popularity", MoC §3.2 "unsaved updates"), reset by :meth:`ExpertPopularity.mark_full`, and by
  :meth:`ExpertPopularity.restored_from` for the experts a lossy recovery restored from an older entry;
* ``since_persisted``: tokens routed to each expert since its last FULL entry written to the durable tier by
  a policy that persists only part of each snapshot (MoC §5.1 two-level PEC), reset by
  :meth:`ExpertPopularity.mark_persisted`. A durable point restores such an expert from that entry, which
  can be older than its last snapshot FULL: the loss of that recovery is counted here.

Besides the counters, each expert's last :data:`FULL_MARKS` FULL marks (``full_marks``: the iteration,
``full_marks_hard``: its ``hard`` count then) make :meth:`ExpertPopularity.since_entry` exact for an entry
older than the last FULL snapshot: a snapshot dropped after it was marked (the store was full), or an entry
skipped as corrupt, leaves recovery restoring an expert from an earlier entry, whose tokens since are
``hard`` now minus ``hard`` at its mark.

Besides the counters, ``routing_digest`` ``[num_layers]`` int64 is a digest of the routing decisions of the
last closed iteration on *this* rank (which tokens of which micro-batch went to which experts,
:func:`routing_digest`); it is not summed over ranks. A sparse-to-dense replay compares it with the recorded
one: equal per-expert counts with different routing are caught too.

Sequence per iteration ``t``: ``record(...)`` for every micro-batch, ``end_iteration(t)``, plan,
snapshot, ``mark_full(t, full_experts)``. The tokens of iteration ``t`` are then counted as saved by the
snapshot of iteration ``t`` (a snapshot at ``t`` holds the state after the update of ``t``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from moe_ft.state.operators import OperatorId

SOURCES = ("hard", "soft", "ema", "since_full")
FULL_MARKS = 4
"""FULL marks remembered per expert (:meth:`ExpertPopularity.since_entry` is exact for an entry of any of
them): three snapshots of an expert dropped or damaged in a row are still counted exactly."""
DIGEST_PRIME = 2**31 - 1


def routing_digest(routing_map: torch.Tensor, microbatch: int) -> torch.Tensor:
    """Digest in ``[0, 2**31 - 1)`` (int64 scalar on ``routing_map``'s device, no host sync) of one
    micro-batch's routing decisions: the set of selected ``(microbatch, token, expert)`` triples of
    ``routing_map`` ``[num_tokens, num_experts]``, each mixed through two rounds of a non-linear modular
    hash and summed mod a prime. A linear hash would miss two tokens swapping experts (the sum of their
    keys is unchanged); the squaring rounds make that a ~2**-31 collision. Digests of micro-batches add up
    mod the prime."""
    num_tokens, num_experts = routing_map.shape
    key = torch.arange(num_tokens * num_experts, dtype=torch.int64, device=routing_map.device)
    key = (key + microbatch * num_tokens * num_experts) % DIGEST_PRIME
    x = (key * 48271 + 11) % DIGEST_PRIME
    x = x * x % DIGEST_PRIME
    x = (x * 16807 + 12345) % DIGEST_PRIME
    x = x * x % DIGEST_PRIME
    return (x * routing_map.reshape(-1).to(torch.int64)).sum() % DIGEST_PRIME


@dataclass(kw_only=True)
class PopularityConfig:
    """Shape and smoothing of the popularity counters."""

    moe_layers: Sequence[int]
    """Global (0-based) indices of the transformer layers that hold an MoE block, in any order."""
    num_experts: int
    """Global number of experts per MoE layer."""
    ema_alpha: float = 0.9
    """Decay ``alpha`` of the time-decayed popularity (MoEvement App. B); weight of the past, in [0, 1)."""
    device: str | None = None
    """Device of the per-iteration buffers that ``record`` adds to and ``all_reduce`` receives. ``None``
    (default): the device of the routing tensors, taken at the first ``record`` (on GPU training the
    counting stays on the GPU: no host sync per micro-batch, one device-to-host read per iteration in
    ``end_iteration``; on CPU nothing changes). ``"cpu"`` / ``"cuda"`` pin it. The counters the policies
    read always live on the CPU."""

    def __post_init__(self) -> None:
        layers = list(self.moe_layers)
        if not layers:
            raise ValueError("PopularityConfig.moe_layers is empty; pass the indices of the MoE layers")
        if len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"PopularityConfig.moe_layers must be distinct non-negative ints, got {layers}")
        if self.num_experts < 1:
            raise ValueError(f"PopularityConfig.num_experts must be >= 1, got {self.num_experts}")
        if not 0.0 <= self.ema_alpha < 1.0:
            raise ValueError(f"PopularityConfig.ema_alpha must be in [0, 1), got {self.ema_alpha}")


def move_buffer(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``buf`` on ``device``; a host buffer holding only zeros is re-created there instead of copied, so
    that moving an empty accumulator does not synchronise the host with the device."""
    if buf.device.type == "cpu" and not bool(buf.any()):
        return torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    return buf.to(device)


def normalized_hhi(shares: torch.Tensor) -> torch.Tensor:
    """Normalised Herfindahl-Hirschman skew ``S = (HHI - 1/E) / (1 - 1/E)`` (MoEvement App. D).

    ``shares``: ``[..., E]`` non-negative token counts or fractions (normalised here). Returns ``[...]``:
    0 for uniform popularity, 1 when one expert receives every token. A row with no tokens has skew 0
    (no evidence of skew). ``E`` must be >= 2.
    """
    num_experts = shares.shape[-1]
    if num_experts < 2:
        raise ValueError("the normalised HHI needs at least 2 experts")
    x = shares.to(torch.float64)
    total = x.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, x / torch.where(total > 0, total, torch.ones_like(total)), 1.0 / num_experts)
    hhi = (p * p).sum(dim=-1)
    return ((hhi - 1.0 / num_experts) / (1.0 - 1.0 / num_experts)).clamp(0.0, 1.0)


class ExpertPopularity:
    """Per-layer, per-expert token counters. See the module docstring for the call sequence.

    ``all_reduce``: optional in-place sum over the ranks whose tokens must be combined (on Megatron:
    ``lambda t: torch.distributed.all_reduce(t, group=...)`` over the data- and expert-parallel ranks,
    and across pipeline stages so that every stage sees every layer; tensor-parallel peers that see the
    same tokens must not be summed twice). It receives one float64 tensor ``[2, num_layers, num_experts]``
    per iteration, on the device of the routing tensors (or ``config.device`` when set): a CUDA tensor on
    GPU, so the callable must suit that device (an NCCL group, or a helper that stages it for gloo).

    On GPU nothing in ``record`` reads device memory from the host: counts and routing digests accumulate
    on the device and ``end_iteration`` reads them back in one transfer.
    """

    def __init__(
        self, config: PopularityConfig, all_reduce: Optional[Callable[[torch.Tensor], object]] = None
    ) -> None:
        self.config = config
        self.all_reduce = all_reduce
        self._layer_pos = {layer: i for i, layer in enumerate(self.config.moe_layers)}
        shape = (len(self._layer_pos), self.config.num_experts)
        device = config.device or "cpu"  # None: moved to the routing tensors' device by the first record
        # [hard|soft, L, E] of the open iteration
        self._pending = torch.zeros((2, *shape), dtype=torch.float64, device=device)
        self.hard = torch.zeros(shape, dtype=torch.float64)
        self.soft = torch.zeros(shape, dtype=torch.float64)
        self.ema = torch.zeros(shape, dtype=torch.float64)
        self.since_full = torch.zeros(shape, dtype=torch.float64)
        self.last_counts = torch.zeros(shape, dtype=torch.float64)  # hard counts of the last closed iteration
        self.last_full_iteration = torch.full(shape, -1, dtype=torch.int64)
        self.since_persisted = torch.zeros(shape, dtype=torch.float64)
        self.last_persisted_iteration = torch.full(shape, -1, dtype=torch.int64)
        # each expert's newest FULL marks, newest first: the iteration (-1: none) and ``hard`` then
        self.full_marks = torch.full((FULL_MARKS, *shape), -1, dtype=torch.int64)
        self.full_marks_hard = torch.zeros((FULL_MARKS, *shape), dtype=torch.float64)
        self.last_iteration = -1  # last iteration closed by end_iteration
        # routing digest of the open iteration per layer (rank-local) and of the last closed one
        self._digest_pending = torch.zeros(shape[0], dtype=torch.int64, device=device)
        self._microbatches = [0] * shape[0]  # record() calls per layer in the open iteration
        self._dirty = False  # anything recorded since the last end_iteration (else the buffers are zero)
        self.routing_digest = torch.zeros(shape[0], dtype=torch.int64)

    # ----------------------------------------------------------------------------------- layout
    @property
    def moe_layers(self) -> list[int]:
        return list(self.config.moe_layers)

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def layer_pos(self, layer_idx: int) -> int:
        """Row of ``layer_idx`` in the ``[num_layers, num_experts]`` counters."""
        try:
            return self._layer_pos[layer_idx]
        except KeyError:
            raise ValueError(
                f"layer {layer_idx} is not an MoE layer of this model; known MoE layers: {self.moe_layers}"
            ) from None

    # ---------------------------------------------------------------------------------- writing
    def record(self, layer_idx: int, routing: torch.Tensor, probs: Optional[torch.Tensor] = None) -> None:
        """Count one micro-batch of one MoE layer.

        ``routing``: either Megatron's ``routing_map`` ``[num_tokens, num_experts]`` (bool or 0/1), or
        per-expert token counts ``[num_experts]`` (e.g. ``tokens_per_expert``). ``probs``: optional gate
        probabilities ``[num_tokens, num_experts]`` (zeros outside the top-k are fine); their per-expert sum
        is the soft count. Without ``probs`` the soft count of this micro-batch equals the hard count.
        """
        row = self.layer_pos(layer_idx)
        num_experts = self.config.num_experts
        routing = routing.detach()
        if self.config.device is None and routing.device != self._pending.device:
            self._follow(routing.device)
        device = self._pending.device
        if routing.dim() == 2 and routing.shape[1] == num_experts:
            hard = routing.to(device=device, dtype=torch.float64).sum(dim=0)
            digest = routing_digest(routing.to(device=device), self._microbatches[row])
            self._digest_pending[row] = (self._digest_pending[row] + digest) % DIGEST_PRIME
            self._microbatches[row] += 1
        elif routing.dim() == 1 and routing.shape[0] == num_experts:
            hard = routing.to(device=device, dtype=torch.float64)
        else:
            raise ValueError(
                f"routing must be a routing map [num_tokens, {num_experts}] or counts [{num_experts}], "
                f"got shape {tuple(routing.shape)}"
            )
        if probs is None:
            soft = hard
        else:
            if probs.dim() != 2 or probs.shape[1] != num_experts:
                raise ValueError(f"probs must be [num_tokens, {num_experts}], got {tuple(probs.shape)}")
            soft = probs.detach().to(device=device, dtype=torch.float64).sum(dim=0)
        self._pending[0, row] += hard
        self._pending[1, row] += soft
        self._dirty = True

    def _follow(self, device: torch.device) -> None:
        """Move the open iteration's buffers to ``device`` (once: the routing tensors stay on one device)."""
        self._pending = move_buffer(self._pending, device)
        self._digest_pending = move_buffer(self._digest_pending, device)

    def end_iteration(self, iteration: int) -> None:
        """Close iteration ``iteration``: aggregate across ranks and fold the counts into every counter."""
        if iteration <= self.last_iteration:
            raise ValueError(
                f"end_iteration({iteration}) after iteration {self.last_iteration} was closed; to replay "
                "iterations restore the counters with load_state_dict first"
            )
        pending = self._pending.clone()
        if self.all_reduce is not None:
            self.all_reduce(pending)  # on the buffers' device: the routing tensors' one by default
        # one device-to-host read per iteration: the summed counts and this rank's routing digests (below
        # 2**31, exact in float64) in one tensor
        host = torch.cat([pending.reshape(-1), self._digest_pending.to(torch.float64)]).cpu()
        # The rest is host bookkeeping on every iteration of the training thread: without the CPU
        # compatibility layer's torch-function mode (~10 us per tensor call through Python; nothing here
        # creates a device tensor, and zeroing the device buffers in place does not need it).
        with torch._C.DisableTorchFunction():
            num_counts = pending.numel()
            pending = host[:num_counts].view(pending.shape)
            hard, soft = pending[0], pending[1]
            self.hard += hard
            self.soft += soft
            self.since_full += hard
            self.since_persisted += hard
            alpha = self.config.ema_alpha
            self.ema = alpha * self.ema + (1.0 - alpha) * hard
            self.last_counts = hard  # a view of this iteration's own host copy
            self.last_iteration = iteration
            self._pending.zero_()
            self.routing_digest = host[num_counts:].to(torch.int64)
            self._digest_pending.zero_()
        self._microbatches = [0] * len(self._microbatches)
        self._dirty = False

    def mark_full(self, iteration: int, experts: Iterable[OperatorId]) -> None:
        """Experts in ``experts`` (non-expert operators are ignored) got a FULL snapshot at ``iteration``:
        their tokens-since-last-FULL restart from zero, and the mark is remembered with the ``hard`` count
        of now (:meth:`since_entry`). Called when the snapshot is submitted: one the store later drops
        keeps its mark, and recovery restores from an earlier one."""
        rows, cols = self._reset(self.since_full, self.last_full_iteration, iteration, experts)
        if rows:
            with torch._C.DisableTorchFunction():
                marks, marks_hard = self.full_marks.numpy(), self.full_marks_hard.numpy()
                marks[1:, rows, cols] = marks[:-1, rows, cols]  # fancy indexing reads a copy first
                marks_hard[1:, rows, cols] = marks_hard[:-1, rows, cols]
                marks[0, rows, cols] = iteration
                marks_hard[0, rows, cols] = self.hard.numpy()[rows, cols]

    def mark_persisted(self, iteration: int, experts: Iterable[OperatorId]) -> None:
        """Experts in ``experts`` (non-expert operators are ignored) had their FULL entry of ``iteration``
        written to the durable tier by a policy that persists part of each snapshot (MoC §5.1): their
        tokens-since-last-persisted-FULL restart from zero."""
        self._reset(self.since_persisted, self.last_persisted_iteration, iteration, experts)

    def _reset(self, counter: torch.Tensor, last: torch.Tensor, iteration: int,
               experts: Iterable[OperatorId]) -> tuple[list[int], list[int]]:
        """Restart ``counter`` and set ``last`` to ``iteration`` for ``experts``; returns their rows and columns."""
        rows, cols = [], []
        for op in experts:
            if not op.is_expert:
                continue
            row = self.layer_pos(op.layer)
            if not 0 <= op.expert < self.config.num_experts:
                raise ValueError(f"{op} has an expert index outside [0, {self.config.num_experts})")
            rows.append(row)
            cols.append(op.expert)
        if rows:  # the host counters through NumPy views: no tensor call per expert (every snapshot)
            with torch._C.DisableTorchFunction():
                counter.numpy()[rows, cols] = 0.0
                last.numpy()[rows, cols] = iteration
        return rows, cols

    def since_entry(self, full_at: Mapping[tuple[int, int], int]) -> torch.Tensor:
        """``[num_layers, num_experts]``: the tokens each expert ``(layer, expert)`` saw since its FULL entry
        of iteration ``full_at[(layer, expert)]`` (experts not in ``full_at``: 0). Exact for the entry of
        any of its last :data:`FULL_MARKS` FULL marks (``hard`` minus ``hard`` at the mark: its last FULL
        snapshot's is ``since_full``; an older one's when a newer snapshot was dropped or is damaged) and
        for that of its last persisted FULL when that is older (``since_persisted``: a durable point
        restores it from there); for an older entry still ``since_full`` is a lower bound."""
        out = torch.zeros_like(self.since_full)
        with torch._C.DisableTorchFunction():  # host counters: one NumPy read per expert
            full, persisted = self.since_full.numpy(), self.since_persisted.numpy()
            last_full, last_persisted = self.last_full_iteration.numpy(), self.last_persisted_iteration.numpy()
            marks, marks_hard, hard = self.full_marks.numpy(), self.full_marks_hard.numpy(), self.hard.numpy()
            dst = out.numpy()
            for (layer, expert), f in full_at.items():
                row = self.layer_pos(layer)
                if f == last_full[row, expert]:
                    dst[row, expert] = full[row, expert]
                elif f == last_persisted[row, expert]:
                    dst[row, expert] = persisted[row, expert]
                elif f >= 0 and f in (mine := marks[:, row, expert].tolist()):
                    dst[row, expert] = hard[row, expert] - marks_hard[mine.index(f), row, expert]
                else:
                    dst[row, expert] = full[row, expert]
        return out

    def restored_from(self, full_at: Mapping[tuple[int, int], int], lost: torch.Tensor, *,
                      durable: bool = False) -> None:
        """A lossy recovery restored expert ``(layer, expert)`` from its FULL entry of iteration ``f =
        full_at[(layer, expert)]`` and reported ``lost[row, expert]`` of its tokens lost (``[num_layers,
        num_experts]``, :meth:`since_entry` for an entry older than the point, 0 for the point's own). Its
        live state is that entry's, so ``since_full`` restarts from zero and ``last_full_iteration`` is
        ``f``; the reported tokens leave ``since_persisted`` too (what remains are the saved but not
        persisted ones before ``f``). Left in the counters, a second recovery from the same entry would
        report them again (MoC §3.1.2, MoEtion §6). An entry of the point's own iteration is what
        :meth:`mark_full` would record. ``durable``: the entries came from the durable tier, so each is
        also the expert's last persisted FULL (as :meth:`mark_persisted` would record). Its FULL marks are
        that entry alone, marked now: tokens since it are counted from here on (the older marks' entries
        are not what its live state came from)."""
        rows, cols, its = [], [], []
        for (layer, expert), f in full_at.items():
            rows.append(self.layer_pos(layer))
            cols.append(expert)
            its.append(f)
        if rows:
            with torch._C.DisableTorchFunction():  # host counters, as in mark_full
                self.since_full.numpy()[rows, cols] = 0.0
                self.last_full_iteration.numpy()[rows, cols] = its
                marks, marks_hard = self.full_marks.numpy(), self.full_marks_hard.numpy()
                marks[:, rows, cols] = -1
                marks[0, rows, cols] = its
                marks_hard[:, rows, cols] = 0.0
                marks_hard[0, rows, cols] = self.hard.numpy()[rows, cols]
                persisted = self.since_persisted.numpy()
                if durable:
                    persisted[rows, cols] = 0.0
                    self.last_persisted_iteration.numpy()[rows, cols] = its
                else:
                    persisted[rows, cols] = (persisted[rows, cols] - lost.numpy()[rows, cols]).clip(min=0.0)

    # ---------------------------------------------------------------------------------- reading
    def counter(self, source: str) -> torch.Tensor:
        """The ``[num_layers, num_experts]`` counter named ``source`` (one of ``SOURCES``); a view, do not
        modify."""
        if source not in SOURCES:
            raise ValueError(f"unknown popularity source {source!r}; expected one of {SOURCES}")
        return getattr(self, source)

    def value(self, op: OperatorId, source: str = "hard") -> float:
        """Counter ``source`` of expert operator ``op``."""
        if not op.is_expert:
            raise ValueError(f"popularity is counted for experts only, got {op}")
        return float(self.counter(source)[self.layer_pos(op.layer), op.expert])

    def skew(self, source: str = "hard") -> torch.Tensor:
        """Normalised HHI skew per MoE layer ``[num_layers]`` (MoEvement App. D)."""
        return normalized_hhi(self.counter(source))

    # ------------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Everything needed to continue counting exactly (tensors are copies). Includes the micro-batch
        counts of an open iteration, so a snapshot taken mid-iteration also restores exactly."""
        return {
            "moe_layers": list(self.config.moe_layers),
            "num_experts": self.config.num_experts,
            "hard": self.hard.clone(),
            "soft": self.soft.clone(),
            "ema": self.ema.clone(),
            "since_full": self.since_full.clone(),
            "last_counts": self.last_counts.clone(),
            "last_full_iteration": self.last_full_iteration.clone(),
            "since_persisted": self.since_persisted.clone(),
            "last_persisted_iteration": self.last_persisted_iteration.clone(),
            "full_marks": self.full_marks.clone(),
            "full_marks_hard": self.full_marks_hard.clone(),
            "pending": self._host_copy(self._pending),
            "last_iteration": self.last_iteration,
            "routing_digest": self.routing_digest.clone(),
            "routing_digest_pending": self._host_copy(self._digest_pending),
            "routing_microbatches": list(self._microbatches),
        }

    def _host_copy(self, buf: torch.Tensor) -> torch.Tensor:
        """Host copy of an open-iteration buffer; zeros without a device read when nothing was recorded
        (the usual case: the runtime snapshots right after ``end_iteration``)."""
        if not self._dirty:
            return torch.zeros(buf.shape, dtype=buf.dtype)
        return buf.cpu().clone()

    def load_state_dict(self, state: dict) -> None:
        if list(state["moe_layers"]) != list(self.config.moe_layers) or state["num_experts"] != self.num_experts:
            raise ValueError(
                f"popularity state for layers {state['moe_layers']} x {state['num_experts']} experts does not "
                f"match this model ({self.moe_layers} x {self.num_experts})"
            )
        for name in ("hard", "soft", "ema", "since_full", "last_counts"):
            setattr(self, name, state[name].to(torch.float64).clone())
        self.last_full_iteration = state["last_full_iteration"].to(torch.int64).clone()
        # states saved before the persisted counters existed: nothing known persisted (since_entry then
        # counts from the last snapshot FULL, as those versions did)
        self.since_persisted = state.get("since_persisted", state["since_full"]).to(torch.float64).clone()
        self.last_persisted_iteration = state.get(
            "last_persisted_iteration", torch.full(self.last_full_iteration.shape, -1)).to(torch.int64).clone()
        # states saved before the FULL marks existed: none known (since_entry then counts as those versions did)
        self.full_marks = state.get("full_marks", torch.full(self.full_marks.shape, -1)).to(torch.int64).clone()
        self.full_marks_hard = state.get("full_marks_hard", torch.zeros(self.full_marks_hard.shape)).to(
            torch.float64).clone()
        self._pending = state["pending"].to(device=self._pending.device, dtype=torch.float64).clone()
        self.last_iteration = int(state["last_iteration"])
        # states saved before the routing digest existed restore an empty one
        num_layers = len(self._microbatches)
        self.routing_digest = state.get("routing_digest", torch.zeros(num_layers, dtype=torch.int64)).to(torch.int64).clone()
        self._digest_pending = state.get("routing_digest_pending", torch.zeros(num_layers, dtype=torch.int64)).to(
            device=self._digest_pending.device, dtype=torch.int64).clone()
        self._microbatches = list(state.get("routing_microbatches", [0] * num_layers))
        self._dirty = bool(state["pending"].any()) or any(self._microbatches)
