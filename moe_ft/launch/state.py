"""What ``moe-ft launch``'s agent holds, and its connection to the launch store: the bottom layer of
:class:`~moe_ft.launch.agent.SpareAgent`.

The agent is torch elastic's ``LocalElasticAgent`` in layers, one job each, every layer using only those
below it (``agent.py`` lists them). This one declares the agent's state -- the rendezvous round's layout,
which node runs which rank, the ranks dead and the nodes lost, this node's processes and spares -- and
reaches the store that the agents and the workers share (``protocol.py``).
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext

from moe_ft.launch import protocol
from moe_ft.launch.logs import LaunchLogs

START_THREAD = "moe-ft-launch-start"
"""The name of the agent's start thread (``AgentState._starter``)."""


@dataclass
class WorkerProcess:
    """A process of this node, a worker or a spare, in a process context of its own."""

    context: PContext
    local_rank: int
    """The device index this process holds for its whole life (``LOCAL_RANK``)."""
    slot: str = ""
    """A spare's slot (its key in the store); ``""`` for a worker started with a rank."""

    @property
    def pid(self) -> int:
        return next(iter(self.context.pids().values()))


@dataclass
class NodeWatch:
    """The heartbeat this agent watches: the next live node's, in ring order."""

    node: int
    beat: int
    since: float
    """``time.monotonic()`` when ``beat`` was first seen."""
    seen: float
    """``time.monotonic()`` of the latest read that found ``beat`` unchanged (or first found it)."""
    silent: float = 0.0
    """Seconds of silence counted so far: each gap between two reads counts for at most half the timeout
    (``SpareAgent._beat_and_watch``)."""


class AgentState(LocalElasticAgent):
    """The agent's state and its launch store (the layers above read and change both)."""

    def __init__(self, spec, logs: LaunchLogs, *, spares_per_node: int = 0,
                 reform_timeout_s: float = protocol.DEFAULT_REFORM_TIMEOUT_S,
                 node_timeout_s: float = protocol.DEFAULT_NODE_TIMEOUT_S,
                 stop_timeout_s: float = protocol.DEFAULT_STOP_TIMEOUT_S, start_method: str = "spawn",
                 shutdown_timeout: int = 30, inprocess: bool = True, min_nodes: int | None = None,
                 max_nodes: int = 1) -> None:
        if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
            super().__init__(spec, logs_specs=DefaultLogsSpecs(log_dir=logs.root), start_method=start_method,
                             shutdown_timeout=shutdown_timeout)
        else:  # torch < 2.13 (the GPU images' 2.11): the agent has no shutdown timeout of its own
            super().__init__(spec, logs_specs=DefaultLogsSpecs(log_dir=logs.root), start_method=start_method)
            self._shutdown_timeout = shutdown_timeout
        self._logs = logs
        self._spares_per_node = spares_per_node
        self._reform_timeout_s = reform_timeout_s
        self._node_timeout_s = node_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._stopped: dict[int, float] = {}
        """pid of a process of this node seen stopped → ``time.monotonic()`` when it was first seen so."""
        self._inprocess = inprocess
        self._min_nodes = min_nodes
        """``--nnodes MIN:MAX`` with MIN < MAX: a lost node with no spare left shrinks the job in-process
        (``None``: a fixed node count, no shrink)."""
        self._max_nodes = max_nodes
        """``--nnodes``' MAX: a node may join (the job grows in-process) only while fewer nodes are live."""
        self._refunded = -1
        """The fallback attempt whose restart this agent gave back (:meth:`_refund_recovery`), once."""
        self._falling_back = False
        """A fallback was announced (by any agent) since this group started: every node's workers leave for a
        full restart, and an agent that already went back to the rendezvous beats no more -- it is not lost."""
        self._workers: dict[int, WorkerProcess] = {}
        """This node's workers by global rank (a lost node's ranks may run here, on former spares)."""
        self._spares: list[WorkerProcess] = []
        self._started_in_pass: list[WorkerProcess] = []
        """Processes started since this agent's pass began (listed by the start thread, so that a stop signal
        that comes before the caller holds one still stops it; ``processes.py``)."""
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=START_THREAD)
        """Where every process is started: no signal handler interrupts a start there (``processes.py``)."""
        self._spare_exits = 0
        """Spares that exited while waiting since one last took a rank (:data:`~moe_ft.launch.spares.SPARE_EXITS`)."""
        self._published_spares = ""
        self._slots = 0
        self._round_tag = ""
        """``r<rendezvous round>`` (``p<pid>`` without rounds): a spare's slot (``<round>.<node>.<n>``) names its
        round, so that a replacement agent of the same node (a new process counting from 0) never reads an
        assignment given to a spare of the lost one; ``finished/<round>/<node>`` names it too."""
        self._finished_nodes: set[int] = set()
        """Nodes of this round whose workers all finished (``finished/<round>/<node>``): never watched, never
        lost, their spares gone."""
        self._join_refused = False
        """A node waiting to join was told that the job ends without it (once per round)."""
        self._launch_store: Any = None
        self._keys = protocol.Keys(spec.rdzv_handler.get_run_id())
        self._attempt = 0
        self._seen = 0
        """The newest attempt whose announcement this agent applied."""
        self._finished: dict[int, Any] = {}
        """Workers that exited 0, by global rank: their return values."""
        self._dead: dict[int, float] = {}
        """Ranks known dead and not replaced yet → wall time their death was seen."""
        self._freed: dict[int, int] = {}
        """Dead rank of this node → the device index its process held (given to the process that takes it)."""
        self._holders: dict[int, int] = {}
        """Global rank → the node (group rank of the rendezvous round) whose process runs it."""
        self._home: dict[int, int] = {}
        """Global rank → the node the layout puts it on (``holders`` differs after a cross-node take-over)."""
        self._world = 0
        self._groups: dict[int, int] = {}
        """Node → the ``GROUP_RANK`` its workers see: its index among the live nodes (an in-process shrink
        renumbers the nodes for the workers; the agents keep the round's numbers among themselves)."""
        self._lost: set[int] = set()
        self._surplus: set[int] = set()
        """Ranks whose workers the global batch left out (``--ft-elastic``, exit ``STANDBY_EXIT_CODE``): not dead,
        not replaced; a spare runs on their devices."""
        self._awaiting: set[int] = set()
        """Ranks of lost nodes that wait for a replacement node (a fixed ``--nnodes N`` with no spare left): the
        survivors keep their processes meanwhile (an ``"await"`` attempt)."""
        self._watch: NodeWatch | None = None
        self._node = 0
        self._nodes = 1
        self._started = False
        self._regrouping = False
        """Set while a joining node is taken in with the workers kept (``_restart_workers``)."""

    def _endpoint(self, worker_group: WorkerGroup) -> tuple[str, int]:
        """The launch store: the rendezvous backend's ``TCPStore`` (it outlives every worker node), else,
        on one node, the workers' own master store."""
        store = getattr(worker_group.spec.rdzv_handler, "_store", None)
        if isinstance(store, dist.TCPStore):
            return store.host, store.port
        if (worker_group.group_world_size or 1) > 1:
            raise RuntimeError("moe-ft launch replaces ranks across nodes through the rendezvous store: use "
                               "--rdzv-backend c10d, or --full-restart")
        assert worker_group.master_addr is not None and worker_group.master_port is not None
        return worker_group.master_addr, worker_group.master_port

    def _store_client(self, worker_group: WorkerGroup):
        if self._launch_store is None:
            host, port = self._endpoint(worker_group)
            self._launch_store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))
        return self._launch_store
