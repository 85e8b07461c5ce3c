"""Where a node agent listens for its peers' replicas: its host address and its port (derived from its directory,
so that an agent started again after a crash listens where its peers send)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

HOST_ENV = "MOE_FT_AGENT_HOST"
"""The address the node agent listens on for its peers' replicas (default: this host name's address)."""

PORT_ENV = "MOE_FT_AGENT_PORT"
"""The port the node agent listens on for replicas (default: one derived from its directory, so that an agent
started again after a crash listens where its peers send)."""
PORT_FILE = "replica.port"
"""In the agent directory while an agent listens: the port it got. An agent started again after a crash tries
it first (its predecessor may have had to take another port than :func:`agent_port`, and the peers gathered
that one); an agent that exits on its own removes it."""

AGENT_PORTS = (20000, 32000)
"""The agents' port range, ``[start, end)``: below Linux's default ephemeral ports (32768-60999)."""
FALLBACK_PORTS = 32
"""Ports of that range an agent tries after its own are taken (:meth:`ReplicaListener._bind`)."""


def agent_port(agent_dir: str | os.PathLike) -> int:
    """``$MOE_FT_AGENT_PORT``, else a port in [20000, 32000) derived from the agent directory's path (the
    same on every start of the node's agent; peers gathered it once, at build). The range lies below Linux's
    default ephemeral ports (``net.ipv4.ip_local_port_range``: 32768-60999), so that no outgoing
    connection on the node holds it by chance."""
    if os.environ.get(PORT_ENV):
        return int(os.environ[PORT_ENV])
    digest = hashlib.sha1(os.path.realpath(agent_dir).encode()).digest()
    return AGENT_PORTS[0] + int.from_bytes(digest[:4], "big") % (AGENT_PORTS[1] - AGENT_PORTS[0])


def listen_ports(agent_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ports an agent tries, in order: its crashed predecessor's (:data:`PORT_FILE`), then
    :func:`agent_port`."""
    try:
        previous = int((Path(agent_dir) / PORT_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return (agent_port(agent_dir),)
    return tuple(dict.fromkeys((previous, agent_port(agent_dir))))


def agent_host() -> str:
    """``$MOE_FT_AGENT_HOST``, else the address this node's host name resolves to, else loopback."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
