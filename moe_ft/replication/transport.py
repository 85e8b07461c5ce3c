"""Moving one rank's recovery point to a peer: the :class:`Transport` interface (in the spirit of torchft's
``CheckpointTransport.send_checkpoint/recv_checkpoint``) and two implementations:

* :class:`GlooTransport` — point-to-point ``send``/``recv`` of host (uint8) tensors on a *dedicated* gloo
  process group, so replication never queues behind training collectives; blobs go in chunks.
* :class:`InProcessTransport` — queues between endpoints of one :class:`InProcessHub` (tests, and the
  single-process benchmark).

A transport moves opaque :class:`PointMessage`s; it does not look inside blobs. Verification and
publishing are the receiver's (``receiver.py``). Each ordered pair (src, dst) is a FIFO; one thread may
send to a peer while another receives from it. ``tests/test_replication_transport.py`` runs the same
contract against both implementations.
"""

from __future__ import annotations

import abc
import json
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_ft import comm


@dataclass(frozen=True)
class PointMessage:
    """A recovery point of rank ``owner`` at ``iteration``: the owner's manifest (with its checksums) and
    the entry files being replicated (``blob name -> bytes``, possibly a subset of the manifest; the node
    agent's are views of its one receive buffer)."""

    owner: int
    iteration: int
    manifest: bytes
    blobs: Mapping[str, bytes | memoryview] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(len(b) for b in self.blobs.values())


class PeerUnreachable(OSError):
    """A peer that cannot be reached now (its node agent is down or restarting): the message did not reach
    it. The sender skips the point for that peer and goes on; the next point tries again."""


class PointSink(abc.ABC):
    """The sending half: what a :class:`~moe_ft.replication.sender.ReplicaSender` needs (the node agent's
    sockets, ``moe_ft/agent/replicas.py``, deliver into the peers' agents, which publish on arrival)."""

    @abc.abstractmethod
    def send_point(self, dst: int, message: PointMessage) -> int:
        """Deliver ``message`` to ``dst`` (blocking the calling thread, never the training step, which
        never calls it); returns the payload bytes sent."""

    @abc.abstractmethod
    def close_to(self, dst: int) -> None:
        """Tell ``dst`` that no more messages come from this rank."""


class Transport(PointSink):
    """Point-to-point delivery of :class:`PointMessage`s between ranks, both halves."""

    rank: int

    @abc.abstractmethod
    def receive(self, src: int) -> PointMessage | None:
        """Next message from ``src`` (blocking); ``None`` once ``src`` called :meth:`close_to`."""


class InProcessHub:
    """The shared medium of :class:`InProcessTransport` endpoints (one FIFO per ordered pair)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], queue.Queue] = {}

    def channel(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())

    def endpoint(self, rank: int) -> "InProcessTransport":
        return InProcessTransport(self, rank)


class InProcessTransport(Transport):
    def __init__(self, hub: InProcessHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def send_point(self, dst: int, message: PointMessage) -> int:
        # copy, as a wire would: the receiver must not share the sender's buffers
        self.hub.channel(self.rank, dst).put(PointMessage(owner=message.owner, iteration=message.iteration,
                                                          manifest=bytes(message.manifest),
                                                          blobs={k: bytes(v) for k, v in message.blobs.items()}))
        return message.nbytes

    def receive(self, src: int) -> PointMessage | None:
        return self.hub.channel(src, self.rank).get()

    def close_to(self, dst: int) -> None:
        self.hub.channel(self.rank, dst).put(None)


@dataclass(kw_only=True)
class GlooTransportConfig:
    chunk_bytes: int = 4 << 20
    """Largest single ``send``: bounds the transient copy and lets several peers' streams interleave."""
    timeout_s: float = 24 * 3600.0
    """Timeout of the dedicated group; a receiver waits for the next point this long at most."""

    def build_group(self, ranks: list[int] | None = None):
        """The dedicated gloo group (host traffic); collective: every rank of the default group must call it."""

        return comm.new_host_group(ranks, timeout_s=self.timeout_s, desc="MOE_FT_REPLICATION_GLOO")


_DATA, _CLOSE = 1, 0


class GlooTransport(Transport):
    """Send/recv of uint8 host tensors on ``group`` (a dedicated gloo group, :meth:`GlooTransportConfig.build_group`).

    Wire format of one message to a peer: ``int64[2] = (kind, header length)``, the JSON header
    ``{"owner", "iteration", "manifest": n, "blobs": [[name, n], ...]}``, the manifest, then each blob in
    chunks of at most ``chunk_bytes``. Ranks are global ranks."""

    def __init__(self, config: GlooTransportConfig, group) -> None:
        self.config, self.group, self._dist = config, group, dist
        self.rank = dist.get_rank()

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.send(tensor, dst, group=self.group)

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        self._dist.recv(tensor, src, group=self.group)

    def _send_bytes(self, data, dst: int) -> None:
        view = memoryview(data)
        for start in range(0, len(view), self.config.chunk_bytes):
            chunk = bytearray(view[start:start + self.config.chunk_bytes])  # torch needs writable memory
            self._send(torch.frombuffer(chunk, dtype=torch.uint8), dst)

    def _recv_bytes(self, nbytes: int, src: int) -> bytes:
        out = bytearray(nbytes)
        for start in range(0, nbytes, self.config.chunk_bytes):
            end = min(nbytes, start + self.config.chunk_bytes)
            buf = torch.empty(end - start, dtype=torch.uint8)
            self._recv(buf, src)
            out[start:end] = buf.numpy().tobytes()
        return bytes(out)

    def send_point(self, dst: int, message: PointMessage) -> int:
        header = json.dumps({"owner": message.owner, "iteration": message.iteration,
                             "manifest": len(message.manifest),
                             "blobs": [[k, len(v)] for k, v in message.blobs.items()]}).encode()
        self._send(torch.tensor([_DATA, len(header)], dtype=torch.int64), dst)
        self._send_bytes(header, dst)
        self._send_bytes(message.manifest, dst)
        for blob in message.blobs.values():
            self._send_bytes(blob, dst)
        return message.nbytes

    def receive(self, src: int) -> PointMessage | None:
        head = torch.empty(2, dtype=torch.int64)
        self._recv(head, src)
        kind, length = int(head[0]), int(head[1])
        if kind == _CLOSE:
            return None
        if kind != _DATA:
            raise RuntimeError(f"replication stream from rank {src} is out of sync (message kind {kind}); "
                               "both ends must use the same moe-ft version and one thread per peer")
        header = json.loads(self._recv_bytes(length, src))
        manifest = self._recv_bytes(header["manifest"], src)
        blobs = {name: self._recv_bytes(n, src) for name, n in header["blobs"]}
        return PointMessage(owner=header["owner"], iteration=header["iteration"], manifest=manifest, blobs=blobs)

    def close_to(self, dst: int) -> None:
        self._send(torch.tensor([_CLOSE, 0], dtype=torch.int64), dst)
