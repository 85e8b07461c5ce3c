"""``--ft-rebalance-interval N``: re-plan the expert replicas inside the running job (Lazarus §4.3, §5).

Lazarus "periodically rebalances the expert allocation and updates the placement plan" as the loads drift
(§4.1; every 200 steps in its evaluation), and reconfigures "lazily, only after the current training step is
finished" (§5). This component decides *when* and *from what*; ``rebalance.py`` plans the moves and
``live.py`` makes them. After iteration ``r`` with ``(r + 1) % N == 0``:

1. the loads are the popularity counters' moving average (``ExpertPopularity.ema``: the routing history of
   the recent iterations), summed over all ranks -- the same on every rank, and restored with every
   snapshot's metadata, so a replayed run re-plans identically;
2. :func:`~moe_ft.elastic.rebalance.plan_rebalance` re-allocates every layer by eq. 1; a layer whose replica
   counts do not change keeps its placement. Nothing changes: nothing moves (one log line);
3. otherwise :meth:`FTRuntime.reconfigure` runs :func:`~moe_ft.elastic.live.apply_rebalance`: the experts a
   rank gains arrive from a current holder, and the snapshot of ``r`` becomes a dense point (every operator
   FULL, the policy's ``start_dense``): the new plan is recoverable as soon as it is published, and no
   recovery ever replays across ``r``;
4. after that snapshot is published on every rank (engine flush, then a barrier), the layout record carries
   the new plans under the next generation (``inventory.py``). A restart before that builds the old plans,
   recovers from the old points and, re-executing ``r``, rebalances again the same way (step 1); a restart
   after it builds the new plans and recovers from ``r`` or later. Both are exact.

It runs while a recovery re-executes iterations too: the original run rebalanced there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from moe_ft import comm
from moe_ft.elastic.live import apply_rebalance, current_plans, elastic_layers
from moe_ft.elastic.rebalance import plan_rebalance
from moe_ft.placement.allocation import held_fault_threshold
from moe_ft.placement.layers import ExpertPlacementConfig
from moe_ft.runtime.components import Component
from moe_ft.state.registry import OperatorRegistry


def rebalance_component(args, runtime, recorder) -> "LiveRebalance | None":
    """The component for ``--ft-rebalance-interval N > 0`` (``None`` otherwise)."""
    elastic = args.extra.get("ElasticConfig")
    if elastic is None or elastic.ft_rebalance_interval <= 0:
        return None
    if recorder is None:
        raise RuntimeError("--ft-rebalance-interval needs the --ft-elastic layout records")
    return LiveRebalance(elastic, runtime, recorder)


class LiveRebalance(Component):
    def __init__(self, elastic, runtime, recorder) -> None:
        self.interval = elastic.ft_rebalance_interval
        self.runtime, self.recorder = runtime, recorder
        self.layers = elastic_layers(runtime.state.model)
        first = next(iter(current_plans(self.layers).values()))
        slots = sum(row[0] for row in first)  # every EP rank has the same number of slots
        # after a shrink the restart planned with f lowered to what this world holds (reshape.py); eq. 1 with
        # the flag's f would refuse every rebalance here, and after a grow the flag's f fits again
        f = held_fault_threshold(elastic.ft_fault_threshold, num_nodes=len(first[0]), slots_per_node=slots,
                                 num_experts=len(first))
        self.placement = ExpertPlacementConfig(slots_per_node=slots, min_replicas=f, strategy=elastic.ft_placement)
        self.pending: tuple[int, dict] | None = None
        """``(iteration, new plans)`` moved but not yet in the layout record (until its dense point is out)."""
        self.history: list[dict] = []

    # ------------------------------------------------------------------------------------- decide
    def loads(self) -> dict[int, list[float]]:
        """``{layer: recent tokens per expert}``, identical on every rank (see the module docstring)."""
        popularity = self.runtime.popularity
        ema = popularity.ema.clone()
        if popularity.all_reduce is None:  # per-rank counters: sum them (host path)
            ema = comm.all_reduce_host(ema)
        return {layer: ema[popularity.layer_pos(layer)].tolist() for layer in self.layers}

    def on_iteration_end(self, iteration: int, replaying: bool) -> None:
        rt = self.runtime
        if (iteration + 1) % self.interval or rt.registry is None:
            return
        plan = plan_rebalance(current_plans(self.layers), self.loads(), config=self.placement)
        entry = {"iteration": iteration, "replaying": replaying, "changed": plan.changed,
                 "replicas": {str(k): v for k, v in plan.replica_counts().items()},
                 "fetches": len(plan.fetches)}
        if plan.changed:
            model, optimizer = rt.state.model, rt.state.optimizer

            def change(registry):
                return apply_rebalance(plan, layers=self.layers, optimizer=optimizer, registry=registry,
                                       rebuild_registry=lambda: OperatorRegistry.from_megatron(model, optimizer))

            t0 = time.perf_counter()
            stats = rt.reconfigure(iteration, change)
            per_rank = comm.all_gather_object(stats)
            entry.update(seconds=round(time.perf_counter() - t0, 4), plans={str(k): v for k, v in plan.new.items()},
                         experts_moved=sum(s["experts_received"] for s in per_rank),
                         bytes_moved=sum(s["bytes_received"] for s in per_rank))
            self.pending = (iteration, dict(plan.new))
        self.history.append(entry)
        if rt.rank == 0:
            what = (f"moved {entry['experts_moved']} expert copies ({entry['bytes_moved'] / 1e6:.2f} MB) in "
                    f"{entry['seconds']:.3f} s; replicas per expert {entry['replicas']}") if plan.changed else \
                "the allocation did not change; nothing moved"
            print(f"moe-ft rebalance: after iteration {iteration}: {what}", flush=True)

    # ------------------------------------------------------------------------------------- record
    def after_snapshot(self, iteration: int, plan, session, replaying: bool) -> None:
        if self.pending is None or self.pending[0] != iteration:
            return
        for s in self.runtime.sessions:  # the dense point of the new plan is published here ...
            s.engine.flush()
        comm.barrier()  # ... and on every rank: only now may a restart build the new plans
        self.recorder.adopt_plans(self.pending[1])
        self.pending = None

    def close(self) -> None:
        if self.runtime.rank == 0 and self.history:
            path = Path(self.runtime.config.report_dir())
            path.mkdir(parents=True, exist_ok=True)
            with open(path / f"rebalance_rank0_{self.history[0]['iteration']}.json", "w") as f:
                json.dump(self.history, f, indent=1)
