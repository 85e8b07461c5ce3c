"""``--ft-elastic`` in the runtime: layout records after every iteration, the reshape restore at start.

The plan decision is taken at model build (``ElasticConfig.replica_map`` -> ``restart.decide``); this
component carries it into the running job: :meth:`ElasticRecorder.restore` restores a reshaped start
(``restore.py``) and writes the report, :meth:`after_iteration` keeps this rank's layout record current
(``inventory.py``) so that the next restart knows the plan and the loads.
"""

from __future__ import annotations

import time

from moe_ft import comm
from moe_ft.drills.report import dump_parameters
from moe_ft.elastic.holders import layer_replica_maps
from moe_ft.elastic.inventory import LayoutRecord, write_record
from moe_ft.elastic.restore import discard_if_behind, discard_node_points, restore_reshaped, write_report
from moe_ft.launch.worker import launch_facts
from moe_ft.recovery.inputs import last_fault_time
from moe_ft.recovery.progress import last_completed
from moe_ft.runtime.components import Component
from moe_ft.state.naming import plan_free_name


def elastic_component(args, runtime) -> "ElasticRecorder | None":
    """The component for ``--ft-elastic`` (``None`` without it)."""
    elastic = args.extra.get("ElasticConfig")
    if elastic is None or not elastic.ft_elastic:
        return None
    if elastic.restart is None:
        raise RuntimeError("--ft-elastic: the model was built without an elastic MoE layer (no plan decided)")
    return ElasticRecorder(elastic.restart, runtime)


class ElasticRecorder(Component):
    def __init__(self, decision, runtime) -> None:
        self.decision, self.runtime = decision, runtime
        cfg = runtime.config
        self.store_dir, self.job_id = cfg.snapshot.store_dir, cfg.snapshot.job_id
        self.maps = {layer: r.tolist() for layer, r in layer_replica_maps(runtime.state.model).items()}
        self.ep_size = len(next(iter(self.maps.values()))[0]) if self.maps else 1
        self.generation = decision.generation
        self._sharded_of: object = None  # the registry _sharded_map was derived from
        self._sharded_map: dict[str, dict[str, int]] = {}
        """Of the plans in :attr:`maps`: bumped by every world change and every in-run rebalance."""

    @property
    def reshaping(self) -> bool:
        return self.decision.kind == "reshape"

    def restore(self) -> int:
        """Collective: restore the reshaped start; returns the iteration training resumes at."""

        rt = self.runtime
        done = last_completed(self.store_dir, self.job_id, rt.rank)
        t0 = time.perf_counter()
        section = restore_reshaped(self.decision, rt)
        section["seconds"] = {"restore": round(comm.max_over_ranks(int((time.perf_counter() - t0) * 1e6)) / 1e6, 4)}
        resumed = comm.max_over_ranks(int(time.time() * 1e3)) / 1e3  # the slowest rank's
        if rt.rank == 0:
            facts = launch_facts(rt.world_size)  # under moe-ft launch: did the survivors keep their processes
            if facts is not None:
                section.update(restart_kind=facts["kind"], survivor_pids_kept=facts["pids_kept"],
                               fallback_reason=facts["reason"])
                if facts.get("detected_at"):  # the agent saw the lost node, or announced the grown job
                    section["seconds"]["announced_to_resume"] = round(resumed - facts["detected_at"], 4)
            fault_at = last_fault_time(rt.faults)
            if fault_at is not None and self.decision.world_size < self.decision.previous.world_size:
                section["seconds"]["kill_to_resume"] = round(resumed - fault_at, 4)
            write_report(self.decision, rt.config.report_dir(), section, last_completed=done)
            print(f"moe-ft elastic: generation {self.decision.generation}: world {self.decision.previous.world_size}"
                  f" -> {self.decision.world_size}, restored iteration {self.decision.iteration} "
                  f"({section['operators_local']} operators node-local, {section['operators_peer']} from peers), "
                  f"resuming at {self.decision.iteration + 1}", flush=True)
        return self.decision.iteration + 1

    def drop_older_generation(self) -> None:
        """Collective, before anything reads the node stores: a node that ran no rank of the generation that
        just ended (it waited as a spare) drops the older generation's points it kept
        (``restore.discard_if_behind``; the decision did not count them)."""
        discard_if_behind(self.decision, self.store_dir, self.job_id, self.runtime.rank, self.runtime.world_size)
        if self.runtime.rank in self.decision.behind:
            print(f"moe-ft elastic: rank {self.runtime.rank}'s node ran no rank of generation "
                  f"{self.decision.previous.generation} (a spare): the older points it kept were dropped", flush=True)

    def report_fallback(self) -> None:
        """A world change that live copies cannot serve: the reason goes into the report (rank 0), and every
        point of the old generation on this node is dropped (collective, ``restore.discard_node_points``: the
        snapshot and survivor points of its old ranks and the replicas it held for any old rank) -- their
        operators belong to the old plan and the old world, so only a point every rank can load remains: the
        durable tier or ``--load`` (the usual recovery path then takes the newest complete one and says so)."""

        if self.decision.kind != "fallback":
            return
        if self.runtime.rank == 0:
            write_report(self.decision, self.runtime.config.report_dir(), {}, last_completed=-1)
            print(f"moe-ft elastic: falling back to the newest complete recovery point: {self.decision.reason}",
                  flush=True)
        discard_node_points(self.store_dir, self.job_id, self.runtime.rank, self.runtime.world_size)

    def adopt_plans(self, plans: dict[int, list[list[int]]]) -> None:
        """An in-run rebalance's plans are recoverable on every rank (``rebalance_component.py``): the next
        record carries them under the next generation."""
        self.maps = {layer: [list(row) for row in rows] for layer, rows in sorted(plans.items())}
        self.generation += 1

    def after_iteration(self, iteration: int) -> None:
        popularity = self.runtime.popularity
        loads = {layer: popularity.hard[i].tolist() for i, layer in enumerate(popularity.config.moe_layers)
                 if layer in self.maps}
        write_record(self.store_dir, self.job_id, self.runtime.rank, LayoutRecord(
            generation=self.generation, world_size=self.runtime.world_size, ep_size=self.ep_size,
            iteration=iteration, plans=self.maps, loads=loads, sharded=self._sharded()))

    def _sharded(self) -> dict[str, dict[str, int]]:
        """``LayoutRecord.sharded`` of this rank's registry, derived once per registry (it is rebuilt only
        when the model's tensors change), not on every iteration."""
        registry = self.runtime.registry
        if registry is None:
            return {}
        if self._sharded_of is not registry:
            self._sharded_map = {str(op): {plan_free_name(p): n for p, n in registry[op].sharded.items()}
                                 for op in registry if registry[op].sharded}
            self._sharded_of = registry
        return self._sharded_map

    def close(self) -> None:
        """Drills (``--ft-digest-out``): the final parameters beside the digest, experts by global id, so that
        an elastic run's deviation from the fault-free run can be measured (``moe_ft/drills/report.py``)."""
        digest_out = self.runtime.config.drill.digest_out
        if digest_out:
            dump_parameters(f"{digest_out}.params_rank{self.runtime.rank}.pt", self.runtime.state.model)
