"""Shared helpers of the ``moe-ft launch`` agent tests: real ``SpareAgent``\\ s whose processes sleep, on a
real ``TCPStore``, with the layout set by the caller (no rendezvous round)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec

from moe_ft.launch.agent import SpareAgent
from moe_ft.launch.logs import LaunchLogs


def launch_store() -> dist.TCPStore:
    """A rendezvous-like store on a free port (the agents are its clients)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def store_client(store: dist.TCPStore) -> dist.TCPStore:
    """Another client of ``store``'s server (one a spare waits on: a wait in the store holds its connection)."""
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=10))


def sleeping_agent(store, tmp_path, run_id: str, local_world_size: int, *, max_restarts: int = 1,
                   **agent_flags) -> tuple[SpareAgent, WorkerGroup]:
    """A real ``SpareAgent`` on ``store`` whose processes sleep, and its worker group (no rendezvous round:
    the caller sets the agent's layout)."""
    handler = SimpleNamespace(_store=store, get_run_id=lambda: run_id, use_agent_store=True)
    spec = WorkerSpec(role="trainer", local_world_size=local_world_size, rdzv_handler=handler,
                      entrypoint="python3", args=("-c", "import time; time.sleep(120)"), max_restarts=max_restarts,
                      monitor_interval=0.1)
    agent = SpareAgent(spec, LaunchLogs(root=str(tmp_path)), **agent_flags)
    group = WorkerGroup(spec)
    group.master_addr, group.master_port = "127.0.0.1", store.port
    return agent, group


def place(agents, *, nodes: int, per_node: int = 1) -> None:
    """Give each agent of ``agents`` (node order) the round's identity layout of ``nodes`` nodes."""
    world = nodes * per_node
    home = {r: r // per_node for r in range(world)}
    for node, agent in enumerate(agents):
        agent._node, agent._nodes, agent._world = node, nodes, world
        agent._round_tag = "r0"  # as _start_workers names the round: no two nodes' spares share a slot
        agent._groups = {n: n for n in range(nodes)}
        agent._home, agent._holders = dict(home), dict(home)
