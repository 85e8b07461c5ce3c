"""The agent of ``moe-ft launch``: torch elastic's ``LocalElasticAgent`` that replaces only what failed.

torch elastic starts a node's workers in one process context, and a context whose process fails
terminates all its processes: one death restarts the whole group. This agent keeps the rendezvous, the
store, the worker specification, the restart budget and the monitor loop of ``LocalElasticAgent``, and
changes three things:

* every worker runs in a process context of its own (``start_processes`` with one process), so a death
  ends only that process;
* ``--spares-per-node N`` starts N more processes with the group. A spare does everything that does not
  depend on its rank (imports, flag parsing, the CPU layer) and then waits in the store for one;
* when a worker dies, the agent gives its rank to a spare (or starts a fresh worker when none is left),
  starts a spare in its place and announces a new attempt in the store (``protocol.py``). The surviving
  workers keep their processes: they leave the failed attempt's process groups and join the new one
  (``worker.py``).

A worker that exits with :data:`~moe_ft.launch.protocol.GAVE_UP_EXIT_CODE` (it could not join a new
attempt in time), or a failure while the restart budget is spent, takes torch elastic's usual path: stop
every worker and restart the group (a full restart, which spends one of ``--max-restarts``). In-process
replacement needs one agent (``--nnodes 1``); with several nodes this agent behaves as torchrun's.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from string import Template
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std, start_processes

from moe_ft.launch import protocol

log = logging.getLogger("moe_ft.launch")


@dataclass
class LaunchLogs:
    """Where each process's logs go (torchrun's ``--log-dir``, ``--redirects``, ``--tee``)."""

    root: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    line_prefix_template: str | None = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="moe_ft_launch_")

    def specs(self, name: str, local_rank: int) -> DefaultLogsSpecs:
        """One process's log specification (a directory of its own: torch elastic clears an attempt's
        directory whenever a context starts, which would erase the other processes' error files)."""
        def pick(value):
            return value.get(local_rank, Std.NONE) if isinstance(value, dict) else value

        assert self.root is not None
        return DefaultLogsSpecs(log_dir=os.path.join(self.root, name), redirects=pick(self.redirects),
                                tee=pick(self.tee))

    def prefix(self, role: str, rank: int | str, local_rank: int) -> dict[int, str] | None:
        if not self.line_prefix_template:
            return None
        return {0: Template(self.line_prefix_template).safe_substitute(role_name=role, rank=rank,
                                                                         local_rank=local_rank)}


@dataclass
class _Process:
    context: PContext
    slot: str = ""
    """A spare's slot (its key in the store); ``""`` for a worker started with a rank."""

    @property
    def pid(self) -> int:
        return next(iter(self.context.pids().values()))


class SpareAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with per-worker processes, warm spares and in-process replacement."""

    def __init__(self, spec, logs: LaunchLogs, *, spares_per_node: int = 0,
                 reform_timeout_s: float = protocol.DEFAULT_REFORM_TIMEOUT_S, start_method: str = "spawn",
                 shutdown_timeout: int = 30, inprocess: bool = True) -> None:
        super().__init__(spec, logs_specs=DefaultLogsSpecs(log_dir=logs.root), start_method=start_method,
                         shutdown_timeout=shutdown_timeout)
        self._logs = logs
        self._spares_per_node = spares_per_node
        self._reform_timeout_s = reform_timeout_s
        self._inprocess = inprocess
        self._workers: dict[int, _Process] = {}
        self._spares: list[_Process] = []
        self._slots = 0
        self._launch_store: Any = None
        self._keys = protocol.Keys(spec.rdzv_handler.get_run_id())
        self._attempt = 0
        self._finished: dict[int, Any] = {}
        """Workers that exited 0, by local rank: their return values."""
        self._started = False

    # ------------------------------------------------------------------------------ processes
    def _store_client(self, worker_group: WorkerGroup):
        if self._launch_store is None:
            assert worker_group.master_addr is not None and worker_group.master_port is not None
            self._launch_store = dist.TCPStore(worker_group.master_addr, worker_group.master_port,
                                               is_master=False, timeout=timedelta(seconds=60))
        return self._launch_store

    def _env(self, worker_group: WorkerGroup, *, rank: int, local_rank: int, slot: str = "") -> dict[str, str]:
        spec = worker_group.spec
        env: dict[str, str] = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(rank), "ROLE_NAME": spec.role, "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker_group.workers[0].world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size or 1),
            "ROLE_WORLD_SIZE": str(worker_group.workers[0].role_world_size),
            "MASTER_ADDR": str(worker_group.master_addr), "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self._attempt), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(self._shutdown_timeout),  # the survivors' dump deadline
        }
        if self._inprocess:  # the workers may outlive a failure: they find the agent's announcements here
            env[protocol.RUN_ENV] = spec.rdzv_handler.get_run_id()
            env[protocol.REFORM_TIMEOUT_ENV] = str(self._reform_timeout_s)
        if slot:
            env[protocol.SPARE_ENV] = slot
        for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    def _start_one(self, worker_group: WorkerGroup, *, name: str, rank: int, local_rank: int,
                   slot: str = "") -> _Process:
        spec = worker_group.spec
        assert spec.entrypoint is not None
        context = start_processes(
            name=spec.role, entrypoint=spec.entrypoint, args={0: tuple(spec.args)},
            envs={0: self._env(worker_group, rank=rank, local_rank=local_rank, slot=slot)},
            logs_specs=self._logs.specs(name, max(local_rank, 0)),
            log_line_prefixes=self._logs.prefix(spec.role, rank if rank >= 0 else f"spare{slot}", max(local_rank, 0)),
            start_method=self._start_method)
        return _Process(context, slot)

    def _start_spare(self, worker_group: WorkerGroup) -> _Process:
        slot = f"{worker_group.group_rank}.{self._slots}"
        self._slots += 1
        return self._start_one(worker_group, name=f"spare_{slot}", rank=-1, local_rank=-1, slot=slot)

    def _fill_spares(self, worker_group: WorkerGroup) -> None:
        while len(self._spares) < self._spares_per_node:
            self._spares.append(self._start_spare(worker_group))

    def _close_all(self, death_sig=None, timeout: int | None = None) -> None:
        for proc in [*self._workers.values(), *self._spares]:
            proc.context.close(death_sig, timeout if timeout is not None else self._shutdown_timeout)
        self._workers, self._spares = {}, []

    # ------------------------------------------------------------------------- the agent's hooks
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._close_all()
        if not self._inprocess:  # several agents: torch elastic's numbering (each agent counts its restarts)
            self._attempt = worker_group.spec.max_restarts - self._remaining_restarts
        elif self._started:  # a full restart: a new attempt (the first start is attempt 0)
            failed = sorted(w.global_rank for w in worker_group.workers)
            self._attempt = protocol.announce(self._store_client(worker_group), self._keys, kind="job", failed=failed,
                                              detected_at=time.time())
        self._started = True
        self._finished = {}
        for worker in worker_group.workers:
            self._workers[worker.local_rank] = self._start_one(
                worker_group, name=f"rank{worker.global_rank}_attempt{self._attempt}", rank=worker.global_rank,
                local_rank=worker.local_rank)
        self._fill_spares(worker_group)
        return {lr: proc.pid for lr, proc in self._workers.items()}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_all()

    def _shutdown(self, death_sig=None, timeout: int = 30) -> None:
        self._close_all(death_sig, timeout)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        failures = {}
        for local_rank, proc in list(self._workers.items()):
            if local_rank in self._finished:
                continue
            result = proc.context.wait(0)
            if result is None:
                continue
            if result.is_failed():
                failures[local_rank] = next(iter(result.failures.values()))
            else:
                self._finished[local_rank] = next(iter(result.return_values.values()), None)
        for spare in list(self._spares):  # a spare that died while waiting is replaced by a new one
            if spare.context.wait(0) is not None:
                log.warning("moe-ft launch: spare %s exited while waiting; starting another", spare.slot)
                self._spares.remove(spare)
        if self._finished and len(self._finished) == len(self._workers):
            for spare in self._spares:
                spare.context.close()
            self._spares = []
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={worker_group.workers[lr].global_rank: v
                                            for lr, v in self._finished.items()})
        if failures:
            gave_up = any(f.exitcode == protocol.GAVE_UP_EXIT_CODE for f in failures.values())
            if not self._inprocess or gave_up or (worker_group.group_world_size or 1) > 1:
                return RunResult(state=WorkerState.FAILED, failures={
                    worker_group.workers[lr].global_rank: f for lr, f in failures.items()})
            self._replace(worker_group, sorted(failures))
        self._fill_spares(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _replace(self, worker_group: WorkerGroup, local_ranks: list[int]) -> None:
        """Give each dead worker's rank to a spare (or a fresh process) and announce the next attempt."""
        detected = time.time()
        assignments: dict[str, dict] = {}
        fresh: list[int] = []
        failed = []
        for local_rank in local_ranks:
            worker = worker_group.workers[local_rank]
            failed.append(worker.global_rank)
            self._workers.pop(local_rank).context.close()  # reap it
            if self._spares:
                proc = self._spares.pop(0)
            else:  # no spare left: a fresh process takes the rank (it imports while the others wait)
                proc = self._start_spare(worker_group)
                fresh.append(worker.global_rank)
            assignments[proc.slot] = {"rank": worker.global_rank, "local_rank": local_rank}
            self._workers[local_rank] = proc
            worker.id = proc.pid
        self._attempt = protocol.announce(self._store_client(worker_group), self._keys, kind="inprocess", failed=failed,
                                          detected_at=detected, assignments=assignments)
        print(f"moe-ft launch: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed; "
              f"attempt {self._attempt} gives {'them' if len(failed) > 1 else 'it'} to "
              f"{'a fresh process' if fresh else 'a spare'}, the other workers keep their processes", flush=True)
