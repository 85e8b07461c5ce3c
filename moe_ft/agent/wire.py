"""The node agents' wire format for replicas (``replicas.py``): frames and their checked headers, TCP keepalive.

Wire format of one frame: ``uint64`` header length (big-endian), the JSON header, then the payload
(the receiving agent answers each frame with a ``uint64`` once it has published or rejected it):
``{"kind": "point", "owner", "iteration", "holder", "root", "job_id", "per_holder", "manifest": n,
"blobs": [[name, n], ...]}`` followed by the manifest and the blobs, or ``{"kind": "close", "owner",
"holder", "root", "job_id", "per_holder"}`` with no payload.
"""

from __future__ import annotations

import json
import socket
import struct

LEN = struct.Struct(">Q")
"""A frame's header length, and the receiving agent's acknowledgement."""
KEEP_POINTS = 8
"""Newest replicated points kept per owner when the owner's frames do not say (``keep``: what the owner's policy
needs for a complete recovery point, :func:`moe_ft.replication.receiver.points_to_keep`)."""
MAX_HEADER_BYTES = 16 << 20
"""Longest frame header accepted: one ``[name, size]`` pair (~60 bytes) per entry makes a quarter of a
million entries, far more than a rank's point holds; a longer one is a bogus length, refused before its
buffer is allocated."""
_MAX_UINT64 = (1 << 64) - 1  # numbers in a header: the acknowledgement carries the iteration as a uint64


def send_frame(sock: socket.socket, header: dict, parts=()) -> None:
    """One frame: the header's length, the header, then each of ``parts`` as it is (no copy)."""
    head = json.dumps(header).encode()
    sock.sendall(LEN.pack(len(head)) + head)
    for part in parts:
        sock.sendall(memoryview(part))


def recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; ``False`` when the connection ends first. A receive that waits longer than
    the socket's timeout raises ``TimeoutError``."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def recv_exact(sock: socket.socket, nbytes: int) -> memoryview | None:
    """``nbytes`` bytes, or ``None`` when the connection ends first (at a frame boundary or inside one)."""
    view = memoryview(bytearray(nbytes))
    return view if recv_into(sock, view) else None


def brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


_HEADER_FIELDS = {"owner": int, "holder": int, "root": str, "job_id": str, "per_holder": bool}
_POINT_FIELDS = {"iteration": int, "manifest": int, "blobs": list}


def _is_uint64(value: object) -> bool:
    # a JSON true is a Python int too: refused as a number
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_UINT64


def parse_header(raw: memoryview) -> dict:
    """A frame's header (see the module docstring), checked before anything is allocated from its sizes or
    written where it says: ``ValueError`` naming the problem (not a JSON object, an unknown kind, a field
    missing or of another type, a number negative or beyond a ``uint64``, a blob not a ``[name, size]`` pair
    or listed twice). Where it says to write is the listener's to check (:meth:`ReplicaListener.destination`)."""
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8; nested too deep for the decoder
        raise ValueError(f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    kind = header.get("kind")
    if kind not in ("point", "close"):
        raise ValueError(f"unknown kind {brief(kind)}")
    for name, kind_of in {**_HEADER_FIELDS, **(_POINT_FIELDS if kind == "point" else {})}.items():
        value = header.get(name)
        if not (_is_uint64(value) if kind_of is int else isinstance(value, kind_of)):
            raise ValueError(f"{name} is {brief(value)}, expected "
                             + ("a number in [0, 2^64)" if kind_of is int else f"a JSON {kind_of.__name__}"))
    keep = header.get("keep", KEEP_POINTS)  # optional: an owner's frames before it was sent keep the default
    if not (_is_uint64(keep) and keep >= 1):
        raise ValueError(f"keep is {brief(keep)}, expected a number of points >= 1")
    names: set[str] = set()
    for blob in header.get("blobs", ()) if kind == "point" else ():
        if not (isinstance(blob, list) and len(blob) == 2 and isinstance(blob[0], str) and _is_uint64(blob[1])):
            raise ValueError(f"blob {brief(blob)} is not a [name, size] pair")
        if blob[0] in names:
            raise ValueError(f"blob {brief(blob[0])} is listed twice")
        names.add(blob[0])
    return header


KEEPALIVE_S = (60, 10, 6)
"""TCP keepalive of an accepted replica connection: first probe after 60 s idle, then every 10 s, 6 unanswered
probes end it. Between messages a connection waits without a limit (:data:`STALL_TIMEOUT_S`); when the sending
node vanished (powered off, partitioned) without closing, the probes end the connection within two minutes and
free its thread, instead of the kernel's default of over two hours."""


def keepalive(sock: socket.socket) -> None:
    """Turn on :data:`KEEPALIVE_S` for ``sock`` (the TCP_KEEP* options where the platform has them)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE_S):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
