"""Worker process supervision for ``moe-ft launch``: each worker and spare in a process context of its own
(torch elastic's ``start_processes`` with one process, so that a death ends only that process), its
environment, its collection when it dies, stopping them all together, and killing a process that stood
stopped past ``--stop-timeout``. A layer of :class:`~moe_ft.launch.agent.SpareAgent`.

**Starts and stop signals.** torch elastic stops its agent with a Python signal handler that raises
``SignalException`` in the main thread, wherever it is. Raised inside ``start_processes`` after the fork
and before the process context comes back (measured: in the forkserver client's read of the new pid,
under ``--preload``), it leaves a process nobody holds: it outlived the agent, and under ``--preload`` the
agent itself never exited (multiprocessing joins the child at exit, and the child, torch's ``_wrap``,
waits for the agent to collect its return value). So every start runs on the agent's start thread, which
no signal handler interrupts, and lists its process (``_started_in_pass``) before handing it back; a stop
signal raises in the main thread while it waits, and :meth:`ProcessSupervision._close_all` lets a start
under way finish, then stops what it started with the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import SignalException, start_processes

from moe_ft.launch import protocol
from moe_ft.launch.state import START_THREAD, AgentState, WorkerProcess

log = logging.getLogger("moe_ft.launch")


class ProcessSupervision(AgentState):
    """Starts, collects and stops this node's processes."""

    def _env(self, worker_group: WorkerGroup, *, rank: int, local_rank: int, slot: str = "") -> dict[str, str]:
        spec = worker_group.spec
        env: dict[str, str] = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(self._groups.get(self._node, self._node)),
            "ROLE_RANK": str(rank), "ROLE_NAME": spec.role, "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(self._world), "GROUP_WORLD_SIZE": str(self._world // spec.local_world_size),
            "ROLE_WORLD_SIZE": str(self._world),
            "MASTER_ADDR": str(worker_group.master_addr), "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self._attempt), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(self._shutdown_timeout),  # the survivors' dump deadline
        }
        if self._inprocess:  # the workers may outlive a failure: they find the agent's announcements here
            host, port = self._endpoint(worker_group)  # and form every attempt's groups through it
            env.update({"MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        protocol.RUN_ENV: spec.rdzv_handler.get_run_id(),
                        protocol.REFORM_TIMEOUT_ENV: str(self._reform_timeout_s)})
            if self._min_nodes is not None:  # nodes may join: the workers look for the agents' regroup
                env[protocol.GROWS_ENV] = "1"
            # NCCL's watchdog, on a failed collective, aborts the communicators and raises in the waiting
            # thread without ending the process (torch's default, 3, ends it: no survivor would stay)
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if slot:
            env[protocol.SPARE_ENV] = slot
        for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    def _start_one(self, worker_group: WorkerGroup, *, name: str, rank: int, local_rank: int,
                   slot: str = "") -> WorkerProcess:
        """Start one process, on the start thread (the module docstring says why); a stop signal that comes
        meanwhile raises here, in the main thread, and the process is stopped with the others."""
        spec = worker_group.spec
        assert spec.entrypoint is not None
        env = self._env(worker_group, rank=rank, local_rank=local_rank, slot=slot)
        handle_stop_signals()
        return self._starter.submit(self._start_listed, spec, name=name, env=env, rank=rank, local_rank=local_rank,
                                    slot=slot).result()

    def _start_listed(self, spec, *, name: str, env: dict[str, str], rank: int, local_rank: int,
                      slot: str) -> WorkerProcess:
        """On the start thread: start the process and list it (``_started_in_pass``) before the main thread
        holds it."""
        assert spec.entrypoint is not None
        context = start_processes(
            name=spec.role, entrypoint=spec.entrypoint, args={0: tuple(spec.args)}, envs={0: env},
            logs_specs=self._logs.specs(name, local_rank),
            log_line_prefixes=self._logs.prefix(spec.role, rank if rank >= 0 else f"spare{slot}", local_rank),
            start_method=self._start_method)
        proc = WorkerProcess(context, local_rank, slot)
        self._started_in_pass.append(proc)
        return proc

    def _reap(self, rank: int, seen: float) -> None:
        """A worker of this node died (seen at wall time ``seen``): its process is collected and its device
        is free for the process that takes its rank (on GPUs the spare's own index may be no device)."""
        proc = self._workers.pop(rank)
        proc.context.close()
        self._dead[rank] = seen
        self._freed[rank] = proc.local_rank

    def _close_all(self, death_sig=None, timeout: int | None = None) -> None:
        """Stop every worker and spare together: each runs in a context of its own, whose ``close`` signals it
        and waits up to ``timeout`` for it (a worker writes its held state before it exits); one after the
        other, N workers would take N times as long, and a scheduler's grace period could end before the
        last was even signalled. A start still under way (a stop signal came during it) finishes first, and
        the processes started since the agent's pass began are stopped too: a stop signal may have come
        before the caller held one (``_started_in_pass``)."""
        self._starter.submit(_nothing).result()
        procs = list({id(p): p for p in [*self._workers.values(), *self._spares, *self._started_in_pass]}.values())
        wait = timeout if timeout is not None else self._shutdown_timeout
        if procs:
            with ThreadPoolExecutor(len(procs), thread_name_prefix="moe-ft-launch-close") as pool:
                list(pool.map(lambda proc: proc.context.close(death_sig, wait), procs))
        self._workers, self._spares, self._started_in_pass = {}, [], []

    def _kill_stopped(self) -> None:
        """Kill this node's processes that stood stopped (SIGSTOP, SIGTSTP: a job-control stop) for
        ``--stop-timeout`` seconds. torch elastic watches exits only: the peers of a stopped rank would wait
        in their collectives until the process groups' timeout (a stopped process's own watchdog cannot
        run). Killed, it is a failed worker (replaced as any) or a spare that exited. A process stopped by a
        debugger (a tracing stop) is left alone."""
        now = time.monotonic()
        stopped: dict[int, float] = {}
        procs = [*((f"rank {r}", p) for r, p in self._workers.items() if r not in self._finished),
                 *((f"spare {p.slot}", p) for p in self._spares)]
        for name, proc in procs:
            pid = proc.pid
            if not is_stopped(pid):
                continue
            stopped[pid] = since = self._stopped.get(pid, now)
            if now - since >= self._stop_timeout_s:
                print(f"moe-ft launch: {name} (pid {pid}) stood stopped for {now - since:.1f} s (--stop-timeout "
                      f"{self._stop_timeout_s:g}): killed, and replaced like a failed process", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._stopped = stopped


def _nothing() -> None:
    """A no-op for the start thread: once it ran, every start submitted before it has finished."""


def _raise_signal_exception(signum: int, frame) -> None:
    """torch elastic's stop: the agent's ``run`` catches ``SignalException`` and stops the workers."""
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


class _SignalsHandledByTheAgent(logging.Filter):
    """torch elastic's ``PContext.start`` warns, at each start off the main thread, that it installs no signal
    handler there; the agent installs them itself (:func:`handle_stop_signals`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.threadName or "").startswith(START_THREAD) or "signal handler" not in record.getMessage()


_QUIET = _SignalsHandledByTheAgent()


def handle_stop_signals() -> None:
    """Install torch elastic's stop handler (``SignalException``) for ``TORCHELASTIC_SIGNALS_TO_HANDLE``, as
    torch's ``PContext.start`` does in the main thread: the agent's starts run on its start thread, where
    torch installs none. Nothing to do off the main thread (Python handles signals there only)."""
    pcontext_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if _QUIET not in pcontext_log.filters:
        pcontext_log.addFilter(_QUIET)
    if threading.current_thread() is not threading.main_thread():
        return
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, _raise_signal_exception)
        else:
            log.warning("moe-ft launch: TORCHELASTIC_SIGNALS_TO_HANDLE names %r, not a signal: not handled", name)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is in a job-control stop (state ``T``; not a debugger's tracing stop)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:  # gone, or not ours to read
        return False
