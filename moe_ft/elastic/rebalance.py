"""Rebalancing expert replicas inside a running job: the plan and the state moves (Lazarus §4.3, §5).

Loads drift during training; Lazarus re-allocates replicas (eq. 1) from the loads measured since the last
plan and re-places them, moving as little state as possible ("periodic rebalancing as loads drift", SPEC §6).
Inside a live job nothing was lost, so every expert has a holder: a rebalance is :func:`reshape.replan` with
``held`` = what each EP rank holds in memory now (:func:`held_from_replicas`). The greedy node mapping keeps
every replica a rank already has; only an expert that a rank gains is fetched, from a current holder (the
fetches spread over the holders, §4.3). A layer whose eq.-1 replica counts did not change keeps its plan
as it is (nothing moves).

Two pieces, no training loop here:

* :func:`plan_rebalance` -- arithmetic only (no process group): new ``R[e][j]`` per layer, the fetches, and
  per EP rank the experts it keeps, gains and drops. Every rank computes the same result from the same
  (all-reduced) loads.
* :func:`move_expert_states` -- executes the fetches on one EP rank's per-expert state (compute weights,
  fp32 master, Adam ``exp_avg``/``exp_avg_sq``/``step``; any dict of tensors per expert): blocking
  sends/receives in one global order over a host (gloo) group, so each pair of ranks meets its transfers in
  the same order and cannot deadlock (the ordering of ``restore.restore_reshaped``). The bytes go through
  pickled tensors on the host path (``docs/communication.md``): bit-exact, no device collective involved.
  A moved expert arrives with exactly the state it had on its source, so a rebalance changes no value.

Exactness: all replicas of an expert hold identical state (``ElasticExperts``: broadcast at build, gradients
summed over the holders before the optimizer step), so it does not matter which holder sends. What a
rebalance does change is which replica serves which tokens; see docs/elastic.md "Rebalancing in a run".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from moe_ft import comm
from moe_ft.elastic.allocation import allocate_replicas
from moe_ft.elastic.planner import PlacementConfig
from moe_ft.elastic.reshape import Fetch, replan

ExpertKey = tuple[int, int]
"""``(layer, expert_idx)``."""


def held_from_replicas(replicas: Mapping[int, Sequence[Sequence[int]]]) -> dict[int, dict[int, set[int]]]:
    """``{layer: {EP rank j: distinct experts with R[e][j] > 0}}`` from ``{layer: R[e][j]}``."""
    out: dict[int, dict[int, set[int]]] = {}
    for layer, rows in replicas.items():
        ep_size = len(rows[0])
        out[layer] = {j: {e for e, row in enumerate(rows) if row[j] > 0} for j in range(ep_size)}
    return out


@dataclass
class RebalancePlan:
    """What one rebalance changes (identical on every rank)."""

    old: dict[int, list[list[int]]]
    new: dict[int, list[list[int]]]
    fetches: list[Fetch] = field(default_factory=list)
    """One per (layer, expert, EP rank that gains it); ``src``: the EP rank that sends it."""

    def held(self, ep_rank: int, *, after: bool) -> set[ExpertKey]:
        rows_by_layer = self.new if after else self.old
        return {(layer, e) for layer, rows in rows_by_layer.items() for e, row in enumerate(rows) if row[ep_rank] > 0}

    def gains(self, ep_rank: int) -> set[ExpertKey]:
        return self.held(ep_rank, after=True) - self.held(ep_rank, after=False)

    def drops(self, ep_rank: int) -> set[ExpertKey]:
        return self.held(ep_rank, after=False) - self.held(ep_rank, after=True)

    @property
    def changed(self) -> bool:
        """Whether any replica count or any rank's expert set differs (a new ``R`` with the same sets still
        changes the dispatch shares)."""
        return self.old != self.new

    def replica_counts(self) -> dict[int, list[int]]:
        """``{layer: replicas per expert}`` of the new plan (the log line)."""
        return {layer: [sum(row) for row in rows] for layer, rows in self.new.items()}


def plan_rebalance(replicas: Mapping[int, Sequence[Sequence[int]]], loads: Mapping[int, Sequence[float]], *,
                   config: PlacementConfig) -> RebalancePlan:
    """New plans from ``loads`` (tokens per expert since the last plan, per layer) for the EP ranks of
    ``replicas`` (the current ``R[e][j]`` per layer). Raises ``ValueError`` on inconsistent inputs."""
    if sorted(replicas) != sorted(loads):
        raise ValueError(f"layers of the current plans {sorted(replicas)} and of the loads {sorted(loads)} differ")
    sizes = {len(rows[0]) for rows in replicas.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layer's plan must cover the same EP ranks, got sizes {sorted(sizes)}")
    for layer, rows in replicas.items():
        if len(loads[layer]) != len(rows):
            raise ValueError(f"layer {layer}: {len(loads[layer])} loads for {len(rows)} experts")
        per_rank = [sum(col) for col in zip(*rows)]
        if any(n != config.slots_per_node for n in per_rank):
            raise ValueError(f"layer {layer}: the current plan fills {per_rank} slots per EP rank but the placement "
                             f"has {config.slots_per_node}; pass the --ft-expert-slots the plan was made with")
        if any(sum(row) == 0 for row in rows):
            raise ValueError(f"layer {layer}: the current plan {rows} leaves an expert without a replica")
    ep_size = sizes.pop()
    old = {layer: [list(row) for row in rows] for layer, rows in replicas.items()}
    # a layer whose eq.-1 counts did not change keeps its placement: re-placing the same counts would move
    # bytes for no change in the dispatch shares
    counts = {layer: allocate_replicas(list(loads[layer]), num_nodes=ep_size, slots_per_node=config.slots_per_node,
                                       min_replicas=config.min_replicas) for layer in replicas}
    moving = sorted(layer for layer in replicas if counts[layer] != [sum(row) for row in old[layer]])
    out = replan({layer: held_from_replicas(replicas)[layer] for layer in moving},
                 {layer: loads[layer] for layer in moving}, ep_size=ep_size, config=config)
    assert not out.lost, "a live plan holds every expert somewhere"
    new = {layer: out.replicas.get(layer, old[layer]) for layer in sorted(replicas)}
    return RebalancePlan(old=old, new=new, fetches=list(out.fetches))


ExpertStates = dict[ExpertKey, dict[str, torch.Tensor]]
"""State tensors by name (weights, master, Adam moments, step) per held expert."""


def move_expert_states(plan: RebalancePlan, states: ExpertStates, *, ep_rank: int, group,
                       global_rank_of_ep: Sequence[int]) -> tuple[ExpertStates, dict]:
    """Run ``plan.fetches`` for EP rank ``ep_rank``.

    ``states``: this rank's state per held expert before the rebalance (keys must equal
    ``plan.held(ep_rank, after=False)``); ``group``: a host (gloo) group containing the ranks of
    ``global_rank_of_ep`` (global rank of every EP rank). Returns the state per held expert after the
    rebalance (kept entries are the same tensors, received ones are new; dropped ones are gone) and the
    stats ``{"bytes_sent", "bytes_received", "experts_received", "seconds"}``.
    """
    have = plan.held(ep_rank, after=False)
    if set(states) != have:
        raise ValueError(f"EP rank {ep_rank} passed state for {sorted(states)} but holds {sorted(have)} under "
                         f"the current plan; pass exactly the experts it holds")
    t0 = time.perf_counter()
    stats = {"bytes_sent": 0, "bytes_received": 0, "experts_received": 0}
    received: ExpertStates = {}
    for f in sorted(plan.fetches, key=lambda f: (f.layer, f.expert_idx, f.dst, f.src)):
        key = (f.layer, f.expert_idx)
        if f.src == ep_rank:
            payload = {name: t.detach().cpu() for name, t in states[key].items()}
            stats["bytes_sent"] += sum(t.nbytes for t in payload.values())
            comm.send_object(payload, global_rank_of_ep[f.dst], group)
        elif f.dst == ep_rank:
            received[key] = comm.recv_object(global_rank_of_ep[f.src], group)
            stats["bytes_received"] += sum(t.nbytes for t in received[key].values())
            stats["experts_received"] += 1
    after = plan.held(ep_rank, after=True)
    out = {key: states[key] for key in sorted(after & have)}
    out.update(received)
    missing = after - set(out)
    assert not missing, f"EP rank {ep_rank} ends without state for {sorted(missing)}"
    stats["seconds"] = round(time.perf_counter() - t0, 6)
    return dict(sorted(out.items())), stats
